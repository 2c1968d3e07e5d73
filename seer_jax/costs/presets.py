"""Accelerator and model presets of the step-time cost models: per-chip peak FLOP/s, HBM
bandwidth and capacity (`AcceleratorSpec`, `get_accelerator`), and what a step costs per token for
one model (`ModelSpec`, `get_model`)."""

from __future__ import annotations

import dataclasses

from seer_jax.costs.spec import ModelSpec, gqa_moe_spec, mla_moe_spec
from seer_jax.errors import ConfigError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class AcceleratorSpec:
    """One chip: dense bf16 peak FLOP/s, HBM bandwidth (bytes/s) and HBM capacity (bytes)."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float


# Public datasheet numbers (dense bf16, no sparsity).
ACCELERATORS: dict[str, AcceleratorSpec] = {
    "tpu-v5e": AcceleratorSpec("tpu-v5e", 197e12, 819e9, 16 * GIB),
    "tpu-v5p": AcceleratorSpec("tpu-v5p", 459e12, 2765e9, 95 * GIB),
    "tpu-v6e": AcceleratorSpec("tpu-v6e", 918e12, 1640e9, 32 * GIB),
    "h100": AcceleratorSpec("h100", 989e12, 3350e9, 80 * GIB),
    "h800": AcceleratorSpec("h800", 989e12, 3350e9, 80 * GIB),
    "h200": AcceleratorSpec("h200", 989e12, 4800e9, 141 * GIB),
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_ACCEL_ALIASES = {"v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "v5litepod": "tpu-v5e"}


def get_accelerator(name: str) -> AcceleratorSpec:
    key = _norm(name)
    key = _ACCEL_ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ConfigError(
            f"unknown accelerator {name!r}; known: {sorted(ACCELERATORS)} "
            "(or give peak_flops/hbm_gbps/hbm_gib explicitly)"
        )
    return ACCELERATORS[key]


def _gqa(kv_heads: int, head_dim: int) -> int:
    return 2 * kv_heads * head_dim


MODELS: dict[str, ModelSpec] = {
    # Llama family (GQA).
    "smollm2-135m": ModelSpec("smollm2-135m", 134.5e6, 134.5e6, 134.5e6, 30, 9, 64, _gqa(3, 64)),
    "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 8.03e9, 8.03e9, 32, 32, 128, _gqa(8, 128)),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7.62e9, 7.62e9, 7.62e9, 28, 28, 128, _gqa(4, 128)),
    "qwen2-vl-72b": ModelSpec("qwen2-vl-72b", 72.7e9, 72.7e9, 72.7e9, 80, 64, 128, _gqa(8, 128)),
    # Mixtures of experts, their parameters computed from the real architecture shapes.
    "qwen3-30b-a3b": gqa_moe_spec(
        "qwen3-30b-a3b", num_layers=48, hidden=2048, num_q_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, experts_per_tok=8, moe_intermediate=768, vocab=151936),
    "qwen3-235b-a22b": gqa_moe_spec(
        "qwen3-235b-a22b", num_layers=94, hidden=4096, num_q_heads=64, num_kv_heads=4,
        head_dim=128, num_experts=128, experts_per_tok=8, moe_intermediate=1536, vocab=151936),
    # DeepSeek-V3-style MoE with MLA: the cache holds a 512-wide latent + 64 RoPE dims per layer;
    # attention runs in the absorbed form over 576-wide keys and 512-wide values.
    "moonlight-16b-a3b": mla_moe_spec(
        "moonlight-16b-a3b", num_layers=27, hidden=2048, num_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=64, experts_per_tok=6, num_shared_experts=2, moe_intermediate=1408,
        intermediate=11264, first_k_dense_replace=1, vocab=163840),
    "kimi-k2": mla_moe_spec(
        "kimi-k2", num_layers=61, hidden=7168, num_heads=64, kv_lora_rank=512,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=384, experts_per_tok=8, num_shared_experts=1, moe_intermediate=2048,
        intermediate=18432, first_k_dense_replace=1, vocab=163840),
}

_MODEL_ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "llama3-8b": "llama-3-8b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "moonlight": "moonlight-16b-a3b",
    "qwen2-vl-72b-instruct": "qwen2-vl-72b",
    "kimi-k2-instruct": "kimi-k2",
    "kimi-k2-1t-a32b": "kimi-k2",
    "moonlight-16b-a3b-instruct": "moonlight-16b-a3b",
    "qwen3-30b-a3b-instruct": "qwen3-30b-a3b",
    "qwen3-235b-a22b-instruct": "qwen3-235b-a22b",
}


def get_model(name: str) -> ModelSpec:
    key = _norm(name)
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[key]
