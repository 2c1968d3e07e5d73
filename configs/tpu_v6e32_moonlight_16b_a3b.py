"""TPU v6e-32 (Trillium, 32 chips of 32 GB): Moonlight-16B-A3B (bf16; DeepSeek-V3 architecture:
multi-head latent attention and a mixture of experts) as 8 instances x tp4.

Each slice of 4 chips (one v6e host) splits the 16 query heads 4 ways and the 64 routed experts
over the same devices (16 whole experts per device, expert parallelism); the 2 shared experts,
the dense first layer, the embedding and the LM head are split too. The latent cache (512 + 64
values per token and layer, 30.4 KiB per token) is shared by every head, so each device holds the
slice's whole cache. Per device: ~7.5 GiB of weights + 18 GiB of latent cache (~620K tokens per
slice; 20 GiB in HBM, whose tiles pad each 576-value row to 640 lanes), of 29.8 GiB.
"""

import ml_collections

from seer_jax.integrations.deploy_config import default_config


def get_config():
    c = default_config()
    c.name = "tpu_v6e32_moonlight_16b_a3b"
    c.platform = "tpu"
    c.model.update(dict(
        name="/models/Moonlight-16B-A3B-Instruct",  # a local HF directory (safetensors + config.json)
        architecture="DeepseekV3ForCausalLM", vocab_size=163840, hidden_size=2048,
        intermediate_size=11264, num_layers=27, num_heads=16, num_kv_heads=16,
        head_dim=192,  # a head's query/key width: qk_nope_head_dim + qk_rope_head_dim
        rope_theta=50000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=8192, dtype="bfloat16"))
    c.model.mla = ml_collections.ConfigDict(dict(
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        q_lora_rank=None, yarn=None))
    # sigmoid routing over one group, 2 shared experts (2 x 1408), the first layer dense
    c.model.moe = ml_collections.ConfigDict(dict(
        num_experts=64, num_experts_per_tok=6, expert_intermediate_size=1408,
        scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446,
        score_correction_bias=True, n_group=1, topk_group=1, shared_intermediate_size=2816,
        dense_layers=(0,)))
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
