"""One 8xH100 host: Moonlight-16B-A3B (bf16; DeepSeek-V3 architecture: multi-head latent
attention and a mixture of experts) as 4 instances x tp2.

Each slice of 2 GPUs splits the 16 query heads 2 ways and the 64 routed experts over the same
GPUs (32 whole experts per GPU, expert parallelism). The latent cache (512 + 64 values per token
and layer, 30.4 KiB per token) is shared by every head, so each GPU holds its slice's whole
cache. Per device: ~14.9 GiB of weights + 40 GiB of latent cache (~1.38M tokens per slice), of
74 GiB usable HBM.
"""

from seer_jax.integrations.deploy_config import default_config
from seer_jax.integrations.deploy_models import use_model


def get_config():
    c = default_config()
    c.name = "gpu_8xh100_moonlight_16b_a3b"
    c.platform = "gpu"
    use_model(c, "moonlight-16b-a3b")
    c.mesh.update(dict(num_instances=4, tp=2, devices=8, hbm_gib_per_device=74.0, chip="h100"))
    c.engine.update(dict(page_size=16, num_pages=0, kv_memory_gib=40.0, max_num_seqs=256,
                         max_num_batched_tokens=4096, max_prefill_seqs=8, max_model_len=8192))
    c.backend.update(dict(kind="ray", resource="GPU", strategy="PACK"))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=7168, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=200, batch_size=64, learning_rate=1e-6, beta=0.0))
    return c
