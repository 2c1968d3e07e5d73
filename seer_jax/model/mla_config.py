"""Multi-head latent attention (MLA) configuration, its mapping from Hugging Face `config.json`
fields (DeepSeek-V2/V3, Kimi-K2, Moonlight), and the size of its paged latent cache.

`MlaConfig` is `ModelConfig.mla`: the latent widths, the query LoRA, and how the rope part is
rotated (DeepSeek's YaRN scaling, interleaved pairs). The heads, hidden size, rope theta and
norm epsilon are the model's (`ModelConfig`).

Per layer a token caches one row [c_kv (kv_lora_rank), k_rope (qk_rope_head_dim)] shared by every
head (the layout of `seer_jax.pallas.mla_layout`), not per-head K and V: 512 + 64 = 576 values for DeepSeek-V3
against 2 x heads x head_dim for a dense cache. Query heads split over tensor-parallel shards;
the latent cache does not (every shard holds it whole). JAX-free, as the rest of the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """DeepSeek-style YaRN (`rope_type: yarn` / `deepseek_yarn`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries projected directly (DeepSeek-V2-Lite)
    yarn: YarnScaling | None = None  # None: plain RoPE on the rope part
    rope_interleave: bool = True  # rope dims stored as (x0, x1), (x2, x3), ... pairs

    def validate(self) -> None:
        for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"mla config {key}={value!r}: must be a positive integer")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank < 1):
            raise ConfigError(f"mla config q_lora_rank={self.q_lora_rank!r}: must be a positive "
                              "integer or None")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"mla config qk_rope_head_dim={self.qk_rope_head_dim}: must be even "
                              "(RoPE rotates pairs)")
        y = self.yarn
        if y is not None and (y.factor <= 0 or y.original_max_position_embeddings < 1):
            raise ConfigError(f"mla config yarn={y}: factor and original_max_position_embeddings "
                              "must be positive")

    @property
    def qk_head_dim(self) -> int:
        """A head's query/key width before absorption: nope + rope."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Cached values per token-layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def cache_bytes_per_token(self, num_layers: int, dtype_bytes: int) -> int:
        """Bytes of one token's latent rows over all layers (one copy; tp shards each hold one)."""
        return num_layers * self.cache_width * dtype_bytes


def yarn_from_hf(hf: dict[str, Any]) -> YarnScaling | None:
    """DeepSeek's YaRN rope scaling of a `config.json` (transformers 4.x `rope_scaling` or 5.x
    `rope_parameters`), None without scaling; other rope types are refused."""
    arch = (hf.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
    rope = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    src = rope if rope.get("rope_type", "default") != "default" else legacy
    kind = src.get("rope_type", src.get("type", "default")) if src else "default"
    if kind in ("default", None):
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"{arch}: rope type {kind!r} is not supported for latent "
                          f"attention; allowed: default, yarn")
    factor = src.get("factor")
    orig = src.get("original_max_position_embeddings")
    if factor is None or orig is None:
        raise ConfigError(f"{arch}: YaRN rope scaling needs factor and "
                          f"original_max_position_embeddings, got {src}")
    if src.get("attention_factor") is not None:
        raise ConfigError(f"{arch}: rope_scaling.attention_factor is not supported "
                          f"(DeepSeek derives it from mscale / mscale_all_dim)")
    return YarnScaling(float(factor), int(orig), float(src.get("beta_fast") or 32),
                       float(src.get("beta_slow") or 1), float(src.get("mscale") or 1.0),
                       float(src.get("mscale_all_dim") or 0.0), bool(src.get("truncate", True)))


def mla_config_from_hf(hf: dict[str, Any]) -> MlaConfig:
    """The MLA fields of a DeepSeek-V2/V3-style `config.json` (ConfigError if one is missing)."""
    missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
               if hf.get(k) is None]
    if missing:
        raise ConfigError(f"config.json has no {', '.join(missing)}: not an MLA model config")
    if hf.get("attention_bias"):
        arch = (hf.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        raise ConfigError(f"{arch}: attention_bias=true is not supported")
    q_lora = hf.get("q_lora_rank")
    cfg = MlaConfig(kv_lora_rank=int(hf["kv_lora_rank"]),
                    qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                    qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                    v_head_dim=int(hf["v_head_dim"]),
                    q_lora_rank=None if q_lora is None else int(q_lora),
                    yarn=yarn_from_hf(hf), rope_interleave=bool(hf.get("rope_interleave", True)))
    cfg.validate()
    return cfg
