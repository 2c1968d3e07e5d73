"""The published shapes of the models the deployment configs deploy, in one place: a config
names the model (`use_model`) and sets only its own mesh, engine and run. Values are those of
each checkpoint's config.json (bf16 serving)."""

from __future__ import annotations

import ml_collections

from seer_jax.errors import ConfigError

_QWEN3_MOE = dict(architecture="Qwen3MoeForCausalLM", vocab_size=151936, num_kv_heads=4,
                  head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, max_position_embeddings=40960, dtype="bfloat16")
_DEEPSEEK_V3 = dict(architecture="DeepseekV3ForCausalLM", vocab_size=163840,
                    head_dim=192,  # a head's query/key width: qk_nope_head_dim + qk_rope_head_dim
                    rope_theta=50000.0, tie_word_embeddings=False, dtype="bfloat16")
_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
# DeepSeek-V3 routing: sigmoid scores over one group, the first layer dense
_DEEPSEEK_MOE = dict(num_experts_per_tok=8, scoring="sigmoid", norm_topk_prob=True,
                     score_correction_bias=True, n_group=1, topk_group=1, dense_layers=(0,))
_SOFTMAX_TOP8 = dict(num_experts=128, num_experts_per_tok=8, scoring="softmax",
                     norm_topk_prob=True)

# name -> (model fields, latent attention or None, mixture of experts)
MODELS: dict[str, tuple[dict, dict | None, dict]] = {
    "qwen3-30b-a3b": (
        dict(_QWEN3_MOE, name="/models/Qwen3-30B-A3B", hidden_size=2048, intermediate_size=6144,
             num_layers=48, num_heads=32),
        None,
        dict(_SOFTMAX_TOP8, expert_intermediate_size=768)),
    "qwen3-235b-a22b": (
        dict(_QWEN3_MOE, name="/models/Qwen3-235B-A22B", hidden_size=4096,
             intermediate_size=12288, num_layers=94, num_heads=64),
        None,
        dict(_SOFTMAX_TOP8, expert_intermediate_size=1536)),
    "moonlight-16b-a3b": (
        dict(_DEEPSEEK_V3, name="/models/Moonlight-16B-A3B-Instruct", hidden_size=2048,
             intermediate_size=11264, num_layers=27, num_heads=16, num_kv_heads=16,
             rms_norm_eps=1e-5, max_position_embeddings=8192),
        dict(_MLA, q_lora_rank=None, yarn=None),
        # 2 shared experts (2 x 1408)
        dict(_DEEPSEEK_MOE, num_experts=64, num_experts_per_tok=6, expert_intermediate_size=1408,
             routed_scaling_factor=2.446, shared_intermediate_size=2816)),
    "kimi-k2": (
        dict(_DEEPSEEK_V3, name="/models/Kimi-K2-Instruct", hidden_size=7168,
             intermediate_size=18432, num_layers=61, num_heads=64, num_kv_heads=64,
             rms_norm_eps=1e-6, max_position_embeddings=131072),
        dict(_MLA, q_lora_rank=1536,
             yarn=dict(factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                       beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)),
        # one shared expert
        dict(_DEEPSEEK_MOE, num_experts=384, expert_intermediate_size=2048,
             routed_scaling_factor=2.827, shared_intermediate_size=2048)),
}


def use_model(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """Set `c.model` (and its `mla`, `moe`) to the published shape of `name`. `c.model.name`
    is where the checkpoint is expected: a local Hugging Face directory (safetensors +
    config.json)."""
    if name not in MODELS:
        raise ConfigError(f"unknown deployment model {name!r}; known: {sorted(MODELS)}")
    model, mla, moe = MODELS[name]
    c.model.update(dict(model))
    if mla is not None:
        c.model.mla = ml_collections.ConfigDict(dict(mla))
    c.model.moe = ml_collections.ConfigDict(dict(moe))
    return c
