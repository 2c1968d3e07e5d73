"""One 8xH100 host: Qwen3-30B-A3B (bf16, a mixture of experts) as 4 instances x tp2.

Each slice of 2 GPUs holds the 128 experts split over its devices (64 whole experts per GPU,
expert parallelism) and the attention split over the same GPUs (32 query heads, 4 KV heads: two
per GPU). Per device: ~28.5 GiB of weights (27 of them experts) + 40 GiB of KV, of 80 GiB HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "gpu_8xh100_qwen3_30b_a3b"
    c.platform = "gpu"
    use_model(c, "qwen3-30b-a3b")
    c.mesh.update(dict(num_instances=4, tp=2, devices=8, hbm_gib_per_device=74.0, chip="h100"))
    c.engine.update(dict(page_size=16, num_pages=0, kv_memory_gib=80.0, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_prefill_seqs=8, max_model_len=17408))
    c.backend.update(dict(kind="ray", resource="GPU", strategy="PACK"))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=16384, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=200, batch_size=64, learning_rate=1e-6, beta=0.0))
    return c
