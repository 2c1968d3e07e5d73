"""Four 8xH200 hosts: Kimi-K2 (1.03T parameters, 32B active; bf16; DeepSeek-V3 architecture:
multi-head latent attention and a mixture of experts) as one instance x tp32, the slice spanning
the four hosts.

Kimi-K2's checkpoint stores its linear weights in float8 with block scales; the engine
dequantizes them on load, so they are held in bf16: ~1.9 TiB. On two hosts (tp16) that is ~121
GiB per GPU, leaving under 10 GiB of the 131 for the latent cache and the step (~130K tokens), so
the slice is four hosts: one Ray actor per host (8 GPUs each), the four joined under
jax.distributed. The 64 query heads split 32 ways (2 per GPU) and the 384 routed experts over the
same GPUs (12 whole experts per GPU, expert parallelism). The latent cache (512 + 64 values per
token and layer, 68.6 KiB per token over 61 layers) is shared by every head, so each GPU holds
the whole cache. Per device: ~61.7 GiB of weights (59 of them experts) + 56 GiB of latent cache
(~855K tokens), of 131 GiB HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "gpu_4x8xh200_kimi_k2"
    c.platform = "gpu"
    use_model(c, "kimi-k2")
    c.mesh.update(dict(num_instances=1, tp=32, devices=32, hbm_gib_per_device=131.0, chip="h200"))
    c.engine.update(dict(page_size=16, num_pages=0, kv_memory_gib=56.0, max_num_seqs=256,
                         max_num_batched_tokens=4096, max_prefill_seqs=8, max_model_len=33792))
    # one Ray actor and one bundle of 8 GPUs per host, each host its own (STRICT_SPREAD); the four
    # hosts of the slice run one engine under jax.distributed
    c.backend.update(dict(kind="ray", resource="GPU", strategy="STRICT_SPREAD", hosts_per_slice=4))
    c.policies = "seer"
    c.controller.chunk_size = 4096
    c.sampling.update(dict(group_size=8, max_tokens=32768, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=100, batch_size=32, learning_rate=1e-6, beta=0.0))
    return c
