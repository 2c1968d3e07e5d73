"""GPU Pallas (Triton lowering) ragged paged MLA attention, absorbed form, with split-K.

The dense GPU kernel's scheme (`attention_gpu`) over the latent cache: grid (num_q_blocks,
head_groups, num_kv_splits); rows are `block_q` packed tokens x one group of at most 16 query
heads (padded to a power of two, as Triton requires); every group reads the same latent rows.
For each sequence overlapping the q block, the split's share of the K/V blocks its causal window
needs is read page by page through the page table (gathered loads of `pages_per_block` pages):
pages larger than a block (about KV_BLOCK_BYTES of c_kv) are read in slices. The c_kv lanes
[0, R) and the k_rope lanes [R, R + Dr) of the cache rows come through two views
of the one cache array, so both load as power-of-two tiles. scores = q_latent . c_kv^T +
q_rope . k_rope^T, online softmax in registers, acc += p . c_kv. Each split writes its
un-normalised accumulator and (m, l); the wrapper merges them (flash-decoding). bf16 dots
accumulate in f32; f32 caches use full-precision dots (no TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from seer_jax.errors import InputError
from seer_jax.pallas.attention_tpu import prepare, unfold
from seer_jax.pallas.cost_estimates import mla_cost
from seer_jax.pallas.kernel_parts import (
    NEG,
    key_mask,
    online_softmax_step,
    split_kv_blocks,
    visible_kv_end,
)
from seer_jax.pallas.limits import gpu_mla_problem, pow2
from seer_jax.pallas.mla_layout import latent_pool_4d

MAX_GROUP_HEADS = 16  # query heads one program holds (its rows x kv_lora_rank f32 accumulator)
KV_BLOCK_BYTES = 32 * 1024  # c_kv bytes of one K/V block (shared memory, per pipeline stage)


def head_groups(num_heads: int) -> int:
    """Programs the query heads split over: groups of MAX_GROUP_HEADS when they divide evenly."""
    if num_heads > MAX_GROUP_HEADS and num_heads % MAX_GROUP_HEADS == 0:
        return num_heads // MAX_GROUP_HEADS
    return 1


def _kernel(
    ql_ref,  # [rows, R]
    qr_ref,  # [rows, Dr]
    meta_ref,  # [rows, 4]
    c_ref,  # [L, total_pages, page_size, R] (the c_kv lanes of the cache)
    r_ref,  # [L, total_pages, page_size, Dr] (the k_rope lanes)
    layer_ref, pages_ref, kv_lens_ref, cu_ref, blk_lo_ref, blk_hi_ref,
    o_ref,  # [rows, R] f32 (this split)
    m_out_ref, l_out_ref,  # [rows] f32
    *, sm_scale: float, block_q: int, page_size: int, pages_per_block: int, sub_blocks: int,
    num_splits: int, has_tree: bool,
):
    b = pl.program_id(0)
    split = pl.program_id(2)
    layer = layer_ref[0]
    rows, rank = ql_ref.shape
    rope_dim = qr_ref.shape[1]
    kv_blk = pages_per_block * page_size // sub_blocks
    exact_f32 = False if c_ref.dtype == jnp.float32 else None
    ql = (ql_ref[...].astype(jnp.float32) * sm_scale).astype(c_ref.dtype)
    qr = (qr_ref[...].astype(jnp.float32) * sm_scale).astype(c_ref.dtype)
    # per row [rows, 1]: sequence, absolute position, visibility end, tree bits
    row_seq, row_qpos, row_vis, row_bits = (meta_ref[:, i][:, None] for i in range(4))

    def per_seq(seq, carry):
        kv_end = visible_kv_end(seq, b, block_q, kv_lens_ref, cu_ref)
        kb_lo, kb_hi = split_kv_blocks(kv_end, kv_blk, split, num_splits)
        in_seq = row_seq == seq

        def per_kv_block(kb, c):
            o, m, den = c
            if sub_blocks == 1:  # whole pages, gathered
                pages = pages_ref[seq, pl.ds(kb * pages_per_block, pages_per_block)]
                c_kv = c_ref[layer, pages].reshape(kv_blk, rank)
                k_rope = r_ref[layer, pages].reshape(kv_blk, rope_dim)
            else:  # a slice of one page
                page = pages_ref[seq, jax.lax.div(kb, sub_blocks)]
                rows = pl.ds(jax.lax.rem(kb, sub_blocks) * kv_blk, kv_blk)
                c_kv = c_ref[layer, page, rows]
                k_rope = r_ref[layer, page, rows]
            kpos = kb * kv_blk + jnp.arange(kv_blk, dtype=jnp.int32)
            k_ok = kpos < kv_end
            s = (pltriton.dot(ql, c_kv, trans_b=True, allow_tf32=exact_f32)
                 + pltriton.dot(qr, k_rope, trans_b=True, allow_tf32=exact_f32))
            c_kv = jnp.where(k_ok[:, None], c_kv, jnp.zeros_like(c_kv))
            mask = key_mask(kpos[None, :], kv_end, in_seq, row_vis, row_qpos, row_bits, has_tree)
            p, alpha, m_new, den = online_softmax_step(s, mask, m, den)
            o = alpha[:, None] * o + pltriton.dot(p.astype(c_kv.dtype), c_kv,
                                                  allow_tf32=exact_f32)
            return o, m_new, den

        return jax.lax.fori_loop(kb_lo, kb_hi, per_kv_block, carry)

    init = (jnp.zeros((rows, rank), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, den = jax.lax.fori_loop(blk_lo_ref[b], blk_hi_ref[b], per_seq, init)
    o_ref[...] = o
    m_out_ref[...] = m
    l_out_ref[...] = den


def mla_attention_gpu(
    q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    sm_scale: float,
    tree_parents: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """GPU (Triton) kernel; same contract as `seer_jax.pallas.mla.ragged_paged_mla_attention`.
    num_kv_splits: default 4 for decode-like batches (num_tokens <= 2 * max_seqs), else 1."""
    pool, layer_arr = latent_pool_4d(latent_pages, layer)
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    num_layers, total_pages, page_size, _ = pool.shape
    max_seqs, pages_per_seq = page_indices.shape
    problem = gpu_mla_problem(kv_lora_rank=rank, rope_dim=rope_dim, page_size=page_size)
    if problem:
        raise InputError(f"GPU MLA kernel cannot lower: {problem}; use impl='reference'")
    groups = head_groups(num_heads)
    group = num_heads // groups
    gp = pow2(group)
    block_q = pow2(block_q or max(1, 16 // gp))
    # K/V block: about KV_BLOCK_BYTES of c_kv; whole pages gathered, or slices of a big page
    kv_tokens = max(16, KV_BLOCK_BYTES // (rank * pool.dtype.itemsize))
    if pages_per_block:
        pages_per_block, sub_blocks = pow2(pages_per_block), 1
    elif page_size <= kv_tokens:
        pages_per_block, sub_blocks = max(1, kv_tokens // page_size), 1
    else:
        pages_per_block, sub_blocks = 1, page_size // kv_tokens
    pages_per_block = min(pages_per_block, pow2(pages_per_seq))
    if num_kv_splits is None:
        num_kv_splits = 4 if num_tokens <= 2 * max_seqs else 1
    q = jnp.concatenate([q_latent, q_rope], axis=-1)  # [T, H, W]
    q_rows, meta, kv, bad_tok, blk_lo, blk_hi, tp, gp = prepare(
        q, groups, page_size, kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents,
        block_q, group_pad=gp)
    ql_rows, qr_rows = q_rows[..., :rank], q_rows[..., rank:]  # [groups, Tp*Gp, .]
    rows = block_q * gp
    num_blocks = tp // block_q
    pps_pad = -(-pages_per_seq // pages_per_block) * pages_per_block
    pages = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pps_pad - pages_per_seq)))
    pages = jnp.clip(pages, 0, total_pages - 1)
    cu = cu_q_lens.astype(jnp.int32)
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), block_q=block_q, page_size=page_size,
        pages_per_block=pages_per_block, sub_blocks=sub_blocks, num_splits=num_kv_splits,
        has_tree=tree_parents is not None)
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))
    n_rows = tp * gp
    o, m, den = pl.pallas_call(
        kernel,
        grid=(num_blocks, groups, num_kv_splits),
        in_specs=[
            pl.BlockSpec((None, rows, rank), lambda b, h, s: (h, b, 0)),
            pl.BlockSpec((None, rows, rope_dim), lambda b, h, s: (h, b, 0)),
            pl.BlockSpec((rows, 4), lambda b, h, s: (b, 0)),
            pl.BlockSpec((num_layers, total_pages, page_size, rank),
                         lambda b, h, s: (0, 0, 0, 0)),
            pl.BlockSpec((num_layers, total_pages, page_size, rope_dim),
                         lambda b, h, s: (0, 0, 0, rank // rope_dim)),
            full((1,)), full(pages.shape), full(kv.shape), full(cu.shape),
            full(blk_lo.shape), full(blk_hi.shape),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, rank), lambda b, h, s: (s, h, b, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h, s: (s, h, b)),
            pl.BlockSpec((None, None, rows), lambda b, h, s: (s, h, b)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_kv_splits, groups, n_rows, rank), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits, groups, n_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits, groups, n_rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=mla_cost(
            num_tokens=num_tokens, num_heads=num_heads, kv_lora_rank=rank, rope_dim=rope_dim,
            dtype_bytes=pool.dtype.itemsize, max_seqs=max_seqs, pages_per_seq=pages_per_seq,
            page_size=page_size, total_pages=total_pages, block_q=block_q,
            kv_block=pages_per_block * page_size, kernel="seer_mla_attention_gpu"),
        interpret=interpret,
        name="seer_mla_attention_gpu",
    )(ql_rows, qr_rows, meta, pool, pool, layer_arr, pages, kv, cu, blk_lo, blk_hi)
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(den * w, axis=0)
    o_all = jnp.sum(o * w[..., None], axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return unfold(o_all, num_tokens, num_heads, group, gp, bad_tok, q_latent.dtype)
