"""Accelerator and model presets of the step-time cost models: per-chip peak FLOP/s, HBM
bandwidth and capacity (`AcceleratorSpec`, `get_accelerator`), and what a step costs per token for
one model (`ModelSpec`, `get_model`)."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a step costs per token for one model.

    `shared_params` are the parameters every token uses (attention, embeddings, dense FFNs and
    shared experts); for a dense model it equals `total_params`. The routed experts hold the rest,
    of which a token activates `active_params - shared_params`. `kv_elems_per_layer` is the number
    of cached elements per token per layer (2·kv_heads·head_dim for GQA, the latent width for MLA).
    Attention FLOPs use `num_q_heads · attn_head_dim` per (query, key) pair per layer.
    """

    name: str
    total_params: float
    active_params: float
    shared_params: float
    num_layers: int
    num_q_heads: int
    attn_head_dim: int
    kv_elems_per_layer: int
    bytes_per_param: float = 2.0
    kv_bytes_per_elem: float = 2.0

    @property
    def is_moe(self) -> bool:
        return self.total_params > self.active_params

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_elems_per_layer * self.kv_bytes_per_elem


def _gqa(kv_heads: int, head_dim: int) -> int:
    return 2 * kv_heads * head_dim


MODELS: dict[str, ModelSpec] = {
    # Llama family (GQA).
    "smollm2-135m": ModelSpec("smollm2-135m", 134.5e6, 134.5e6, 134.5e6, 30, 9, 64, _gqa(3, 64)),
    "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 8.03e9, 8.03e9, 32, 32, 128, _gqa(8, 128)),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7.62e9, 7.62e9, 7.62e9, 28, 28, 128, _gqa(4, 128)),
    "qwen2-vl-72b": ModelSpec("qwen2-vl-72b", 72.7e9, 72.7e9, 72.7e9, 80, 64, 128, _gqa(8, 128)),
    # DeepSeek-V3-style MoE with MLA: the cache holds a 512-wide latent + 64 RoPE dims per layer;
    # attention runs in the absorbed form over 576-wide keys.
    "moonlight-16b-a3b": ModelSpec(
        "moonlight-16b-a3b", 16.0e9, 3.0e9, 1.6e9, 27, 16, 576, 576
    ),
    "kimi-k2": ModelSpec("kimi-k2", 1.04e12, 32.6e9, 11.5e9, 61, 64, 576, 576),
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
}


def get_model(name: str) -> ModelSpec:
    key = _norm(name)
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[key]
