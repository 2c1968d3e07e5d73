"""TPU v5p-64 pod slice: Qwen3-235B-A22B (bf16, a mixture of experts) as 2 instances x tp16.

32 chips, 2 slices of 16 chips (4 v5p hosts each). Each slice holds the 128 experts split over
its 16 devices (8 whole experts per device, expert parallelism) and the attention over the same
devices (64 query heads: 4 per device; 4 KV heads, each repeated over 4 devices). Per device:
~27.5 GiB of weights (26.4 of them experts) + 50 GiB of KV (a quarter of the slice's 200 GiB, as
each device holds one of the 4 KV heads), of 95 GiB HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "tpu_v5p64_qwen3_235b_a22b"
    c.platform = "tpu"
    use_model(c, "qwen3-235b-a22b")
    c.mesh.update(dict(num_instances=2, tp=16, devices=32, hbm_gib_per_device=88.0, chip="v5p"))
    c.engine.update(dict(page_size=64, num_pages=0, kv_memory_gib=200.0, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_prefill_seqs=8, max_model_len=33792))
    # a slice spans 4 hosts of 4 chips: one Ray bundle per host, jax.distributed within a slice
    c.backend.update(dict(kind="ray", resource="TPU", strategy="STRICT_SPREAD",
                          hosts_per_slice=4))
    c.policies = "seer"
    c.controller.chunk_size = 8192
    c.sampling.update(dict(group_size=16, max_tokens=32768, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=500, batch_size=128, learning_rate=1e-6, beta=0.0))
    return c
