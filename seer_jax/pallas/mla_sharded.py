"""Tensor-parallel MLA: the kernels under `shard_map`, query heads split over a mesh axis.

The latent cache is one "KV head" every query head reads, so each shard holds the whole cache
(replicated) and its share of the heads; the latent write runs on every shard into its own
copy (the same rows everywhere), so the copies stay equal. With `layer` the pool is the whole
cache [num_layers, P, S, W] and the layer index travels into every shard as a replicated scalar.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from seer_jax.errors import InputError
from seer_jax.pallas.mla import ragged_paged_mla_attention
from seer_jax.pallas.mla_write import write_latent


def _tp(mesh: Mesh, axis: str) -> int:
    if axis not in mesh.shape:
        raise InputError(f"mesh has no axis {axis!r} (axes: {tuple(mesh.shape)})")
    return mesh.shape[axis]


def sharded_mla_attention(
    mesh: Mesh, q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    axis: str = "tp", tree_parents=None, layer=None, **kwargs,
) -> jax.Array:
    """`ragged_paged_mla_attention` with the heads of q_latent / q_rope [T, H, .] split over
    `axis` (H divisible by its size) and the latent cache replicated; same result as unsharded.
    kwargs go to `ragged_paged_mla_attention` (sm_scale, impl, interpret, block sizes)."""
    tp = _tp(mesh, axis)
    if q_latent.shape[1] % tp:
        raise InputError(f"num_heads={q_latent.shape[1]} is not divisible by {axis}={tp}")
    heads, rep = P(None, axis, None), P()
    names = (["tree_parents"] if tree_parents is not None else []) + (
        ["layer"] if layer is not None else [])
    extra = tuple(jnp.asarray(x) for x in (tree_parents, layer) if x is not None)

    def body(ql, qr, cache, a, b, c, d, *rest):
        return ragged_paged_mla_attention(ql, qr, cache, a, b, c, d,
                                          **dict(zip(names, rest, strict=True)), **kwargs)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(heads, heads) + (rep,) * (5 + len(extra)), out_specs=heads,
        check_vma=False,
    )(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens,
      jnp.asarray(num_seqs), *extra)


def sharded_write_latent(mesh: Mesh, latent_pages, new_latent, new_rope, slot_mapping, *,
                         axis: str = "tp", layer=None, **kwargs) -> jax.Array:
    """`write_latent` on every shard's copy of the replicated latent cache."""
    _tp(mesh, axis)
    rep = P()
    if layer is None:
        return jax.shard_map(
            lambda c, n, r, s: write_latent(c, n, r, s, **kwargs), mesh=mesh,
            in_specs=(rep,) * 4, out_specs=rep, check_vma=False,
        )(latent_pages, new_latent, new_rope, slot_mapping)
    return jax.shard_map(
        lambda c, n, r, s, li: write_latent(c, n, r, s, layer=li, **kwargs), mesh=mesh,
        in_specs=(rep,) * 5, out_specs=rep, check_vma=False,
    )(latent_pages, new_latent, new_rope, slot_mapping, jnp.asarray(layer, jnp.int32))
