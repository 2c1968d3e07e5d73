"""TPU v5p-64 pod slice: Kimi-K2 (1.03T parameters, 32B active; bf16; DeepSeek-V3 architecture:
multi-head latent attention and a mixture of experts) as one instance x tp32.

Kimi-K2's checkpoint stores its linear weights in float8 with block scales; the engine
dequantizes them on load, so they are held in bf16: ~1.9 TiB, which needs all 32 chips of a v5p-64
(8 hosts of 4 chips, one slice under jax.distributed). The 64 query heads split 32 ways (2 per
device) and the 384 routed experts over the same devices (12 whole experts per device, expert
parallelism). The latent cache (512 + 64 values per token and layer, 68.6 KiB per token over 61
layers) is shared by every head, so each device holds the whole cache. Per device: ~61.7 GiB of
weights (59 of them experts) + 18 GiB of latent cache (~275K tokens; 20 GiB in HBM, whose tiles
pad each 576-value row to 640 lanes) + up to 4 GiB of the step's temporaries, of 88 GiB usable
HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "tpu_v5p64_kimi_k2"
    c.platform = "tpu"
    use_model(c, "kimi-k2")
    c.mesh.update(dict(num_instances=1, tp=32, devices=32, hbm_gib_per_device=88.0, chip="v5p"))
    c.engine.update(dict(page_size=64, num_pages=0, kv_memory_gib=18.0, max_num_seqs=128,
                         max_num_batched_tokens=4096, max_prefill_seqs=8, max_model_len=33792))
    # the slice spans 8 hosts of 4 chips: one Ray bundle per host, jax.distributed within it
    c.backend.update(dict(kind="ray", resource="TPU", strategy="STRICT_SPREAD",
                          hosts_per_slice=8))
    c.policies = "seer"
    c.controller.chunk_size = 4096
    c.sampling.update(dict(group_size=8, max_tokens=32768, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=100, batch_size=32, learning_rate=1e-6, beta=0.0))
    return c
