"""MLA attention for the engine: one call per layer that picks the kernel the `AttentionPlan`
chose (TPU / GPU Pallas, or the jnp reference) and runs it per tensor-parallel shard when the
plan has a mesh.

The latent cache [num_layers, P, S, kv_lora_rank + qk_rope_head_dim] (`pallas.mla_layout`) is
replicated over tp (every head reads it); query heads split. The engine's `cpu` impl runs the
reference (there is no separate CPU decode path for MLA).

A request's exported KV (`KVBlob`) holds its latent rows as k [L, 1, tokens, W] and an empty v.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from seer_jax.engine.attention_backend import AttentionPlan
from seer_jax.errors import ConfigError, InputError
from seer_jax.pallas.limits import gpu_mla_problem, tpu_block_q, tpu_mla_problem
from seer_jax.pallas.mla import ragged_paged_mla_attention
from seer_jax.pallas.mla_sharded import sharded_mla_attention, sharded_write_latent
from seer_jax.pallas.mla_write import write_latent


def mla_impl(plan: AttentionPlan) -> str:
    """The MLA kernel impl for the plan: tpu / gpu, or reference (for reference and cpu)."""
    return plan.impl if plan.kernel else "reference"


def check_mla_kernel_shapes(plan: AttentionPlan, *, num_heads: int, kv_lora_rank: int,
                            rope_dim: int, page_size: int, dtype_bytes: int, max_seqs: int,
                            pages_per_seq: int, max_tokens: int) -> None:
    """ConfigError at engine build if the plan's MLA kernels cannot lower for these shapes
    (num_heads: the model's query heads, split over plan.tp)."""
    if not plan.kernel:
        return
    heads = num_heads // plan.tp
    if plan.impl == "tpu":
        problem = tpu_mla_problem(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                                  page_size=page_size, dtype_bytes=dtype_bytes,
                                  max_seqs=max_seqs, pages_per_seq=pages_per_seq,
                                  num_tokens=max_tokens, block_q=tpu_block_q(heads))
    else:
        problem = gpu_mla_problem(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                                  page_size=page_size)
    if problem:
        raise ConfigError(f"engine config impl={plan.impl!r} cannot run this MLA model/config: "
                          f"{problem}; allowed alternatives: impl='reference' or 'cpu'")


def mla_write(plan: AttentionPlan, latent_all, new_latent, new_rope, slots, layer):
    """Write new rows (c_kv [T, R], k_rope [T, Dr]) of `layer` into the whole latent cache."""
    kw = dict(impl=mla_impl(plan), interpret=plan.interpret, layer=layer)
    if plan.mesh is None:
        return write_latent(latent_all, new_latent, new_rope, slots, **kw)
    return sharded_write_latent(plan.mesh, latent_all, new_latent, new_rope, slots, **kw)


def mla_attention(plan: AttentionPlan, q_latent, q_rope, latent_all, kv_lens, pages, cu, num,
                  *, layer, sm_scale: float, tree_parents=None, max_q_len=None):
    """Absorbed MLA of packed queries (q_latent [T, H, R], q_rope [T, H, Dr]) over `layer` of
    the whole latent cache -> [T, H, R] in the latent space."""
    impl = mla_impl(plan)
    kw = dict(impl=impl, interpret=plan.interpret, layer=layer, tree_parents=tree_parents,
              sm_scale=sm_scale)
    if impl == "reference":
        kw["max_q_len"] = max_q_len
    if plan.mesh is None:
        return ragged_paged_mla_attention(q_latent, q_rope, latent_all, kv_lens, pages, cu, num,
                                          **kw)
    return sharded_mla_attention(plan.mesh, q_latent, q_rope, latent_all, kv_lens, pages, cu,
                                 num, **kw)


def paged_mla_attention(cache, meta, layer, q_latent, q_rope, c_kv, k_rope, *, layout, plan,
                        sm_scale: float):
    """One layer's latent write + absorbed attention over the step's regions (decode, then
    prefill), the engine's MLA counterpart of its K/V attention: the cache is the whole
    [L, P, S, kv_lora_rank + rope] latent pool carried through the layer scan."""
    dtype = cache.dtype
    cache = mla_write(plan, cache, c_kv.astype(dtype), k_rope.astype(dtype), meta["slots"],
                      layer)
    q_latent, q_rope = q_latent.astype(dtype), q_rope.astype(dtype)
    split = layout.n_dec * layout.q_dec

    def attend(lo, hi, prefix, max_q_len, parents=None):
        if f"{prefix}_rows" in meta:  # rows of the persistent device page table
            table = meta["page_table"][meta[f"{prefix}_rows"], :layout.pps]
        else:
            table = meta[f"{prefix}_pages"]
        return mla_attention(plan, q_latent[lo:hi], q_rope[lo:hi], cache,
                             meta[f"{prefix}_kv_lens"], table, meta[f"{prefix}_cu"],
                             meta[f"{prefix}_num"], layer=layer, sm_scale=sm_scale,
                             tree_parents=parents, max_q_len=max_q_len)

    outs = []
    if layout.n_dec:
        outs.append(attend(0, split, "dec", layout.q_dec, meta.get("dec_parents")))
    if layout.n_pre:
        outs.append(attend(split, q_latent.shape[0], "pre", layout.t_pre))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out, cache


def latent_rows_to_host(pool: np.ndarray, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A KV blob's arrays of the latent rows of pages [L, n_pages, S, W] (their first
    `num_tokens`): k [L, 1, n, W] (one row per token-layer, shared by all heads) and an empty v
    [L, 0, n, W]."""
    L, P, S, W = pool.shape
    rows = np.ascontiguousarray(pool.reshape(L, P * S, W)[:, None, :num_tokens])
    return rows, np.zeros((L, 0, num_tokens, W), pool.dtype)


def latent_rows_to_pages(k: np.ndarray, num_pages: int, page_size: int) -> np.ndarray:
    """Inverse of `latent_rows_to_host`: k [L, 1, n, W] -> pages [L, num_pages, S, W]."""
    if k.ndim != 4 or k.shape[1] != 1:
        raise InputError(f"a latent KV blob holds k [num_layers, 1, tokens, width], got {k.shape}")
    L, _, n, W = k.shape
    rows = np.pad(k[:, 0], ((0, 0), (0, num_pages * page_size - n), (0, 0)))
    return rows.reshape(L, num_pages, page_size, W)
