"""TPU v6e-32 (Trillium, 32 chips of 32 GB): Moonlight-16B-A3B (bf16; DeepSeek-V3 architecture:
multi-head latent attention and a mixture of experts) as 8 instances x tp4.

Each slice of 4 chips (one v6e host) splits the 16 query heads 4 ways and the 64 routed experts
over the same devices (16 whole experts per device, expert parallelism); the 2 shared experts,
the dense first layer, the embedding and the LM head are split too. The latent cache (512 + 64
values per token and layer, 30.4 KiB per token) is shared by every head, so each device holds the
slice's whole cache. Per device: ~7.5 GiB of weights + 18 GiB of latent cache (~620K tokens per
slice; 20 GiB in HBM, whose tiles pad each 576-value row to 640 lanes), of 29.8 GiB.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "tpu_v6e32_moonlight_16b_a3b"
    c.platform = "tpu"
    use_model(c, "moonlight-16b-a3b")
    c.mesh.update(dict(num_instances=8, tp=4, devices=32, hbm_gib_per_device=29.8, chip="v6e"))
    c.engine.update(dict(page_size=64, num_pages=0, kv_memory_gib=18.0, max_num_seqs=128,
                         max_num_batched_tokens=4096, max_prefill_seqs=8, max_model_len=8192))
    c.backend.update(dict(kind="ray", resource="TPU", strategy="STRICT_SPREAD"))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=7168, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=500, batch_size=64, learning_rate=1e-6, beta=0.0))
    return c
