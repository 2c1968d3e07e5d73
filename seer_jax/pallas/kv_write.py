"""Write new tokens' K/V into their cache pages (slot = page_index * page_size + offset).

The cache is the combined layout of `seer_jax.pallas.kv_layout`: kv_pages [P, S, 2 * Hkv, D]
(or [L, P, S, 2 * Hkv, D] with a layer index), a token's K and V interleaved per KV head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seer_jax.errors import InputError
from seer_jax.pallas.checks import resolve_impl
from seer_jax.pallas.kv_layout import interleave_kv


def _check(kv_pages, new_k, new_v, slot_mapping, layer) -> None:
    rank = 4 if layer is None else 5
    if kv_pages.ndim != rank or kv_pages.shape[-2] % 2:
        want = "[total_pages, page_size, 2 * num_kv_heads, head_dim]"
        if layer is not None:
            want = "[num_layers, " + want[1:] + " (a layer index is given)"
        raise InputError(f"kv_pages must be {want}, got {kv_pages.shape}")
    combined, head_dim = kv_pages.shape[-2:]
    if new_k.ndim != 3 or new_k.shape != new_v.shape:
        raise InputError(f"new_k/new_v must be [T, num_kv_heads, head_dim], got {new_k.shape}, "
                         f"{new_v.shape}")
    if new_k.shape[1:] != (combined // 2, head_dim):
        raise InputError(f"new_k {new_k.shape} does not match the cache's (num_kv_heads, "
                         f"head_dim) = {(combined // 2, head_dim)}")
    if slot_mapping.shape != (new_k.shape[0],):
        raise InputError(f"slot_mapping must be [{new_k.shape[0]}], got {slot_mapping.shape}")


def write_kv_reference(kv_pages, new_k, new_v, slot_mapping, layer=None):
    """Scatter whole [2 * Hkv, D] token rows; slots < 0 (or beyond the cache) are dropped.
    With `layer`, the pool is [L, P, S, 2 * Hkv, D] and only that layer is written (in place)."""
    total_pages, page_size = kv_pages.shape[-4:-2]
    n_slots = total_pages * page_size
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots)  # out of range -> dropped
    pg, off = slots // page_size, slots % page_size
    new = interleave_kv(new_k, new_v).astype(kv_pages.dtype)  # [T, 2 * Hkv, D]
    if layer is not None:
        return kv_pages.at[layer, pg, off].set(new, mode="drop")
    return kv_pages.at[pg, off].set(new, mode="drop")


def write_kv(
    kv_pages: jax.Array,  # [total_pages, page_size, 2 * num_kv_heads, head_dim]
    new_k: jax.Array,  # [T, num_kv_heads, head_dim]
    new_v: jax.Array,
    slot_mapping: jax.Array,  # [T] int32, -1 = padding token (not written)
    *,
    impl: str = "auto",
    interpret: bool = False,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Return kv_pages with token t's K/V at slot `slot_mapping[t]`.

    Pure function: call it inside a jit that donates the cache (`donate_argnums`) and XLA updates
    the pages in place; the kernels alias input and output buffers (input_output_aliases).
    Two tokens must not share a slot. With `layer`, kv_pages is the whole cache
    [num_layers, total_pages, page_size, 2 * num_kv_heads, head_dim] and that layer is written.
    """
    _check(kv_pages, new_k, new_v, slot_mapping, layer)
    which = resolve_impl(impl)
    if which == "reference":
        return write_kv_reference(kv_pages, new_k, new_v, slot_mapping, layer)
    from seer_jax.pallas import kv_write_kernels

    if which == "tpu":
        return kv_write_kernels.write_kv_tpu(kv_pages, new_k, new_v, slot_mapping,
                                             interpret=interpret, layer=layer)
    return kv_write_kernels.write_kv_gpu(kv_pages, new_k, new_v, slot_mapping,
                                         interpret=interpret, layer=layer)
