"""TPU v5p-64 pod slice: Qwen3-30B-A3B (bf16, a mixture of experts) as 8 instances x tp4.

32 chips (one JAX device per chip), 8 slices of 4 chips (one v5p host each). Each slice holds the
128 experts split over its 4 devices (32 whole experts per device, expert parallelism) and the
attention split over the same devices (32 query heads, 4 KV heads: one per device). Per device:
~14.3 GiB of weights (13.5 of them experts) + 60 GiB of KV, of 95 GiB HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "tpu_v5p64_qwen3_30b_a3b"
    c.platform = "tpu"
    use_model(c, "qwen3-30b-a3b")
    c.mesh.update(dict(num_instances=8, tp=4, devices=32, hbm_gib_per_device=88.0, chip="v5p"))
    c.engine.update(dict(page_size=64, num_pages=0, kv_memory_gib=240.0, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_prefill_seqs=8, max_model_len=33792))
    c.backend.update(dict(kind="ray", resource="TPU", strategy="STRICT_SPREAD"))
    c.policies = "seer"
    c.controller.chunk_size = 8192
    c.sampling.update(dict(group_size=16, max_tokens=32768, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=500, batch_size=128, learning_rate=1e-6, beta=0.0))
    return c
