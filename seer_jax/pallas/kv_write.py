"""Write new tokens' K/V into their cache pages (slot = page_index * page_size + offset)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seer_jax.errors import InputError
from seer_jax.pallas.checks import resolve_impl


def _check(k_pages, v_pages, new_k, new_v, slot_mapping, layer) -> None:
    rank = 4 if layer is None else 5
    if k_pages.ndim != rank or k_pages.shape != v_pages.shape:
        want = "[num_kv_heads, total_pages, page_size, head_dim]"
        if layer is not None:
            want = "[num_layers, " + want[1:] + " (a layer index is given)"
        raise InputError(f"k_pages/v_pages must both be {want}, got {k_pages.shape} and "
                         f"{v_pages.shape}")
    num_kv_heads, _, _, head_dim = k_pages.shape[-4:]
    if new_k.ndim != 3 or new_k.shape != new_v.shape:
        raise InputError(f"new_k/new_v must be [T, num_kv_heads, head_dim], got {new_k.shape}, "
                         f"{new_v.shape}")
    if new_k.shape[1:] != (num_kv_heads, head_dim):
        raise InputError(f"new_k {new_k.shape} does not match the cache's (num_kv_heads, "
                         f"head_dim) = {(num_kv_heads, head_dim)}")
    if slot_mapping.shape != (new_k.shape[0],):
        raise InputError(f"slot_mapping must be [{new_k.shape[0]}], got {slot_mapping.shape}")


def write_kv_reference(k_pages, v_pages, new_k, new_v, slot_mapping, layer=None):
    """Scatter into the flattened slot axis; slots < 0 (or beyond the cache) are dropped.
    With `layer`, the pools are [L, Hkv, P, S, D] and only that layer is written (in place)."""
    num_kv_heads, total_pages, page_size, head_dim = k_pages.shape[-4:]
    n_slots = total_pages * page_size
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots)  # out of range -> dropped
    pg, off = slots // page_size, slots % page_size

    def put(pages, new):
        if layer is not None:
            return pages.at[layer, :, pg, off].set(new.astype(pages.dtype), mode="drop")
        flat = pages.reshape(num_kv_heads, n_slots, head_dim)
        flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")
        return flat.reshape(pages.shape)

    return put(k_pages, new_k), put(v_pages, new_v)


def write_kv(
    k_pages: jax.Array,  # [num_kv_heads, total_pages, page_size, head_dim]
    v_pages: jax.Array,
    new_k: jax.Array,  # [T, num_kv_heads, head_dim]
    new_v: jax.Array,
    slot_mapping: jax.Array,  # [T] int32, -1 = padding token (not written)
    *,
    impl: str = "auto",
    interpret: bool = False,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Return (k_pages, v_pages) with token t's K/V at slot `slot_mapping[t]`.

    Pure function: call it inside a jit that donates the cache (`donate_argnums`) and XLA updates
    the pages in place; the kernels alias input and output buffers (input_output_aliases).
    Two tokens must not share a slot. With `layer`, k_pages/v_pages are the whole cache
    [num_layers, num_kv_heads, total_pages, page_size, head_dim] and that layer is written.
    """
    _check(k_pages, v_pages, new_k, new_v, slot_mapping, layer)
    which = resolve_impl(impl)
    if which == "reference":
        return write_kv_reference(k_pages, v_pages, new_k, new_v, slot_mapping, layer)
    from seer_jax.pallas import kv_write_kernels

    if which == "tpu":
        return kv_write_kernels.write_kv_tpu(k_pages, v_pages, new_k, new_v, slot_mapping,
                                             interpret=interpret, layer=layer)
    return kv_write_kernels.write_kv_gpu(k_pages, v_pages, new_k, new_v, slot_mapping,
                                         interpret=interpret, layer=layer)
