"""The paged KV cache layout shared by every kernel, the reference and the engine.

One array holds K and V: `kv_pages` [total_pages, page_size, 2 * num_kv_heads, head_dim] for one
layer, or [num_layers, total_pages, page_size, 2 * num_kv_heads, head_dim] for the whole cache.
Within a token's row of 2 * Hkv "combined heads", KV head h has its K at index 2h and its V at
2h + 1. Why this shape:

- Token-major pages. A new token's K/V is the whole [2 * Hkv, D] row at (page, offset): the offset
  lands on an untiled (major) dimension, so the TPU write is one DMA per token at any page size and
  dtype (a dynamic offset on a tiled dimension must be a multiple of the tile: 8 rows, 16 in
  bf16), and the XLA write is a scatter of contiguous rows (no transpose of the cache).
- One DMA per page serves every KV head of a shard; the attention kernel picks a head's K and V
  out of the page in on-chip memory.
- K and V interleaved per head: the second-minor dimension 2 * Hkv is even, so a bf16 cache with
  one KV head per shard still fills whole packed (2-row) sublanes (a separate [.., Hkv=1, D] bf16
  array would be padded to twice its size in TPU HBM), and splitting heads over tensor-parallel
  shards keeps each head's K and V together.

TPU HBM tiles the last two dimensions: a row of C combined heads costs no padding when C (C/2 in
bf16) is 1, 2, 4, 8 or a multiple of 8, and head_dim 64 pads lanes to 128 (twice the bytes).
`padded_bytes_per_token` says what the chip stores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from seer_jax.errors import InputError


def interleave_kv(k, v):
    """K and V [..., Hkv, D] -> combined [..., 2 * Hkv, D] (K of head h at 2h, V at 2h + 1)."""
    if k.shape != v.shape:
        raise InputError(f"k {k.shape} and v {v.shape} must have the same shape")
    xp = np if isinstance(k, np.ndarray) and isinstance(v, np.ndarray) else jnp
    kv = xp.stack([k, v], axis=-2)  # [..., Hkv, 2, D]
    return kv.reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def split_kv(kv):
    """Combined [..., 2 * Hkv, D] -> (K, V), each [..., Hkv, D]."""
    return kv[..., 0::2, :], kv[..., 1::2, :]


def kv_cache_shape(num_layers: int | None, total_pages: int, page_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, ...]:
    """[L, P, S, 2 * Hkv, D], or [P, S, 2 * Hkv, D] for num_layers None."""
    pool = (total_pages, page_size, 2 * num_kv_heads, head_dim)
    return pool if num_layers is None else (num_layers,) + pool


def num_kv_heads_of(kv_pages) -> int:
    """Hkv of a combined pool (its second-minor dimension is 2 * Hkv)."""
    c = kv_pages.shape[-2]
    if c % 2:
        raise InputError(f"kv_pages {tuple(kv_pages.shape)}: the combined-head dimension {c} "
                         "must be even (K and V of each KV head)")
    return c // 2


def pages_to_heads(pages: jax.Array) -> jax.Array:
    """Gathered pages [..., n_pages, S, C, D] -> [C, ..., n_pages * S, D] (head-major tokens)."""
    *lead, n, s, c, d = pages.shape
    x = pages.reshape(*lead, n * s, c, d)
    return jnp.moveaxis(x, -2, 0)


def padded_bytes_per_token(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes one token's K and V occupy per layer in TPU HBM with the cache row-major: the
    (rows, 128-lane) tiles of the last two dims round the 2 * Hkv rows and head_dim lanes up."""
    rows = 2 * num_kv_heads
    pack = max(1, 4 // dtype_bytes)  # bf16 packs two rows per 32-bit sublane
    words = -(-rows // pack)
    tile = next((t for t in (1, 2, 4, 8) if words <= t), None)
    words = tile if tile is not None else -(-words // 8) * 8
    lanes = -(-head_dim // 128) * 128
    return words * pack * lanes * dtype_bytes


def pool_5d(kv_pages, layer):
    """(kv, layer [1] int32): a one-layer [P, S, C, D] pool becomes [1, P, S, C, D]."""
    if kv_pages.ndim == 4:
        if layer is not None:
            raise InputError("layer is only meaningful with a [L, P, S, 2 * Hkv, D] cache")
        return kv_pages.reshape((1,) + kv_pages.shape), jnp.zeros((1,), jnp.int32)
    if layer is None:
        raise InputError(f"a 5-D KV cache {kv_pages.shape} needs a layer index")
    return kv_pages, jnp.asarray(layer, jnp.int32).reshape(1)
