"""One 8xH200 host: Qwen3-235B-A22B (bf16, a mixture of experts) as one instance x tp8.

The slice holds the 128 experts split over its 8 GPUs (16 whole experts per GPU, expert
parallelism) and the attention over the same GPUs (64 query heads: 8 per GPU; 4 KV heads, each
repeated over 2 GPUs). Per device: ~54.7 GiB of weights (52.9 of them experts) + 65 GiB of KV (a
quarter of the slice's 260 GiB, as each GPU holds one of the 4 KV heads), of 131 GiB HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "gpu_8xh200_qwen3_235b_a22b"
    c.platform = "gpu"
    use_model(c, "qwen3-235b-a22b")
    c.mesh.update(dict(num_instances=1, tp=8, devices=8, hbm_gib_per_device=131.0, chip="h200"))
    c.engine.update(dict(page_size=16, num_pages=0, kv_memory_gib=260.0, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_prefill_seqs=8, max_model_len=17408))
    c.backend.update(dict(kind="ray", resource="GPU", strategy="PACK"))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=16384, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=200, batch_size=64, learning_rate=1e-6, beta=0.0))
    return c
