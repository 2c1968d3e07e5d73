"""The paged latent cache of multi-head latent attention (MLA), shared by its kernels.

One array holds, per token, the compressed latent c_kv (`kv_lora_rank` values) followed by the
RoPE key k_rope (`qk_rope_head_dim` values), one row shared by every query head:
`latent_pages` [total_pages, page_size, kv_lora_rank + qk_rope_head_dim] for one layer, or
[num_layers, total_pages, page_size, kv_lora_rank + qk_rope_head_dim] for the whole cache. For
DeepSeek-V3 / Kimi-K2 / Moonlight a row is 512 + 64 = 576 values, against 2 * heads * head_dim
for a dense cache. The cache is not split over tensor-parallel shards: every shard holds it
whole, as every head reads it.

TPU HBM tiles the last two dimensions (page_size rows, row lanes): a 576-value row occupies 640
lanes (five 128-lane tiles), so the chip stores 640 values per token-layer (`padded_bytes...`).
A token's offset in its page indexes a tiled dimension, so the TPU write copies whole tiles of
rows (see `mla_write`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seer_jax.errors import InputError


def latent_width(kv_lora_rank: int, qk_rope_head_dim: int) -> int:
    """Values per token-layer row of the latent cache."""
    return int(kv_lora_rank) + int(qk_rope_head_dim)


def latent_cache_shape(num_layers: int | None, total_pages: int, page_size: int,
                       kv_lora_rank: int, qk_rope_head_dim: int) -> tuple[int, ...]:
    """[L, P, S, kv_lora_rank + qk_rope_head_dim], or [P, S, ...] for num_layers None."""
    pool = (total_pages, page_size, latent_width(kv_lora_rank, qk_rope_head_dim))
    return pool if num_layers is None else (num_layers,) + pool


def latent_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    """Logical bytes of one token's row in one layer: (kv_lora_rank + rope dim) x dtype bytes."""
    return latent_width(kv_lora_rank, qk_rope_head_dim) * int(dtype_bytes)


def padded_latent_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int,
                                  dtype_bytes: int) -> int:
    """Bytes one token's row occupies per layer in TPU HBM: the row's lanes round up to 128
    (page_size rows are whole tiles when page_size is a multiple of the tile's rows)."""
    lanes = -(-latent_width(kv_lora_rank, qk_rope_head_dim) // 128) * 128
    return lanes * int(dtype_bytes)


def latent_pool_4d(latent_pages, layer):
    """(pool [L, P, S, W], layer [1] int32): a one-layer [P, S, W] pool becomes [1, P, S, W]."""
    if latent_pages.ndim == 3:
        if layer is not None:
            raise InputError("layer is only meaningful with a [L, P, S, W] latent cache")
        return latent_pages.reshape((1,) + latent_pages.shape), jnp.zeros((1,), jnp.int32)
    if latent_pages.ndim != 4:
        raise InputError("latent_pages must be [total_pages, page_size, kv_lora_rank + "
                         f"qk_rope_head_dim] (or with a leading layer axis), got "
                         f"{latent_pages.shape}")
    if layer is None:
        raise InputError(f"a 4-D latent cache {latent_pages.shape} needs a layer index")
    return latent_pages, jnp.asarray(layer, jnp.int32).reshape(1)


def tpu_tile_rows(dtype) -> int:
    """Rows of one TPU (rows, 128) memory tile: 8 for 32-bit values, 16 for bf16 (packed)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def split_latent(rows: jax.Array, kv_lora_rank: int) -> tuple[jax.Array, jax.Array]:
    """Rows [..., W] -> (c_kv [..., kv_lora_rank], k_rope [..., W - kv_lora_rank])."""
    return rows[..., :kv_lora_rank], rows[..., kv_lora_rank:]
