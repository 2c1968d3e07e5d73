"""Tensor-parallel wrappers: the kernels under `shard_map`, heads split over a mesh axis.

Query heads are split over `axis`; KV heads too: the cache's combined-head axis (K and V of each
KV head interleaved, see `kv_layout`) splits into whole (K, V) pairs. When there are fewer KV
heads than shards the cache must hold each KV head repeated `tp // num_kv_heads` times
(`repeat_kv_heads_for_tp`; the engine allocates the cache that way once, the wrappers repeat on
the fly otherwise). Each shard then holds whole GQA groups: its query heads all read the KV
head(s) it holds.

With `layer`, the pool is the whole cache [num_layers, P, S, 2 * Hkv, D] and the layer index
travels into every shard as a replicated scalar.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from seer_jax.errors import InputError
from seer_jax.pallas.attention import ragged_paged_attention
from seer_jax.pallas.kv_write import write_kv


def kv_heads_for_tp(num_kv_heads: int, tp: int) -> int:
    """KV heads the cache holds under tp shards: num_kv_heads, or tp when that is larger."""
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise InputError(f"num_kv_heads={num_kv_heads} is not divisible by tp={tp}")
        return num_kv_heads
    if tp % num_kv_heads:
        raise InputError(f"tp={tp} is not a multiple of num_kv_heads={num_kv_heads}")
    return tp


def repeat_kv_heads_for_tp(x: jax.Array, tp: int, axis: int = 0) -> jax.Array:
    """Repeat the KV-head axis of x (new K or V [T, Hkv, D]: axis 1) so it splits evenly over tp
    shards."""
    n = x.shape[axis]
    return jnp.repeat(x, kv_heads_for_tp(n, tp) // n, axis=axis)


def repeat_kv_pages_for_tp(kv_pages: jax.Array, tp: int) -> jax.Array:
    """Repeat each (K, V) pair of a combined cache [..., 2 * Hkv, D] for tp shards."""
    *lead, c, d = kv_pages.shape
    pairs = kv_pages.reshape(*lead, c // 2, 2, d)
    pairs = repeat_kv_heads_for_tp(pairs, tp, axis=len(lead))
    return pairs.reshape(*lead, -1, d)


def _tp(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise InputError(f"mesh has no axis {axis!r} (axes: {tuple(mesh.shape)})")
    return mesh.shape[axis]


def _kv_spec(kv_pages, axis: str) -> P:
    """Shard the combined-head axis (second-minor) of a 4-D pool or a 5-D cache."""
    return P(*([None] * (kv_pages.ndim - 2)), axis, None)


def sharded_ragged_paged_attention(
    mesh: Mesh,
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    axis: str = "tp",
    tree_parents: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    **kwargs,
) -> jax.Array:
    """`ragged_paged_attention` with heads split over mesh axis `axis`; same result as unsharded.

    q: [T, Hq, D] (Hq divisible by tp); kv_pages: [..., 2 * Hkv, D] with Hkv (or
    kv_heads_for_tp(Hkv, tp)) KV heads. kwargs go to `ragged_paged_attention` (impl, interpret,
    sm_scale, block sizes, ...).
    """
    tp = _tp(mesh, axis)
    num_q_heads = q.shape[1]
    if num_q_heads % tp:
        raise InputError(f"num_q_heads={num_q_heads} is not divisible by tp={tp}")
    if kv_pages.shape[-2] // 2 < tp:
        kv_pages = repeat_kv_pages_for_tp(kv_pages, tp)
    hkv = kv_pages.shape[-2] // 2
    kv_heads_for_tp(hkv, tp)
    if num_q_heads % hkv:
        raise InputError(f"num_q_heads={num_q_heads} is not a multiple of the cache's "
                         f"{hkv} KV heads")
    heads = P(None, axis, None)
    kv = _kv_spec(kv_pages, axis)
    rep = P()
    names = (["tree_parents"] if tree_parents is not None else []) + (
        ["layer"] if layer is not None else [])
    extra = tuple(x for x in (tree_parents, layer) if x is not None)

    def body(q, kv, a, b, c, d, *rest):
        return ragged_paged_attention(q, kv, a, b, c, d, **dict(zip(names, rest, strict=True)),
                                      **kwargs)

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(heads, kv, rep, rep, rep, rep) + (rep,) * len(extra),
        out_specs=heads, check_vma=False,
    )(q, kv_pages, kv_lens, page_indices, cu_q_lens, jnp.asarray(num_seqs),
      *(jnp.asarray(x) for x in extra))


def sharded_write_kv(
    mesh: Mesh, kv_pages, new_k, new_v, slot_mapping, *, axis: str = "tp",
    layer: jax.Array | int | None = None, **kwargs
):
    """`write_kv` with KV heads split over `axis` (new_k/new_v: [T, Hkv_cache, D]); with
    `layer`, the pool is the whole cache [num_layers, P, S, 2 * Hkv_cache, D]."""
    _tp(mesh, axis)
    kv = _kv_spec(kv_pages, axis)
    new = P(None, axis, None)
    if layer is None:
        return jax.shard_map(
            functools.partial(write_kv, **kwargs), mesh=mesh,
            in_specs=(kv, new, new, P()), out_specs=kv, check_vma=False,
        )(kv_pages, new_k, new_v, slot_mapping)
    return jax.shard_map(
        lambda c, nk, nv, s, li: write_kv(c, nk, nv, s, layer=li, **kwargs), mesh=mesh,
        in_specs=(kv, new, new, P(), P()), out_specs=kv, check_vma=False,
    )(kv_pages, new_k, new_v, slot_mapping, jnp.asarray(layer, jnp.int32))
