"""Multi-head latent attention (MLA) configuration, its mapping from Hugging Face `config.json`
fields (DeepSeek-V2/V3, Kimi-K2, Moonlight), and the size of its paged latent cache.

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
class MlaConfig:
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries projected directly (DeepSeek-V2-Lite)

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


def mla_config_from_hf(hf: dict[str, Any]) -> MlaConfig:
    """The MLA fields of a DeepSeek-V2/V3-style `config.json` (ConfigError if one is missing)."""
    missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
               if hf.get(k) is None]
    if missing:
        raise ConfigError(f"config.json has no {', '.join(missing)}: not an MLA model config")
    q_lora = hf.get("q_lora_rank")
    cfg = MlaConfig(kv_lora_rank=int(hf["kv_lora_rank"]),
                    qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                    qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                    v_head_dim=int(hf["v_head_dim"]),
                    q_lora_rank=None if q_lora is None else int(q_lora))
    cfg.validate()
    return cfg
