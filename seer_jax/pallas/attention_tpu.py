"""TPU Pallas (Mosaic) ragged paged attention.

Grid (num_q_blocks,). A q block is `sub_blocks` sub-blocks of `block_q` packed tokens; for each
KV head its `group` query heads are folded into rows (token-major), so GQA shares every K/V
fetch. A sequence's K/V blocks are fetched once per q block, and each sub-block holding rows of
the sequence multiplies those its rows can see: a prefill chunk's keys are read once per q block,
and a decode block multiplies each sequence's keys by one sub-block's rows. The
page table, kv_lens, cu_q_lens and each block's sequence range come in by scalar prefetch (SMEM).
The cache ([P, S, 2 * Hkv, D] or the whole [L, P, S, 2 * Hkv, D] with a layer index, see
`kv_layout`) stays in HBM (`pl.ANY`); for each sequence overlapping the block the kernel streams
its pages, `pages_per_block` at a time, by async DMA into a double-buffered VMEM scratch (the
next block's DMAs are in flight while the current one is multiplied). One DMA copies a whole
page, every KV head's K and V, so each page is read once per q block; the kernel then takes each
head's K and V rows out of VMEM (strided sublane loads) and runs an online softmax per head in
f32 scratch. q, K and V stay in the cache dtype for the MXU (bf16 x bf16 with f32 accumulation).
With a layer index the DMAs read the layer's pages straight out of the full cache, so the
engine's layer scan never slices (copies) a layer out. Only the pages a block's causal window
needs are fetched; padding sequences (>= num_seqs) and tokens cost nothing. Per-row metadata
(sequence id, query position, visible prefix, tree-window bits) is precomputed by the wrapper
(see `tree.kernel_tree_mask`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seer_jax.errors import InputError
from seer_jax.pallas.cost_estimates import attention_cost
from seer_jax.pallas.kernel_parts import (
    NEG,
    iota_positions,
    key_mask,
    online_softmax_step,
    page_block_dma,
    visible_kv_end,
)
from seer_jax.pallas.kv_layout import pool_5d
from seer_jax.pallas.limits import (
    tpu_attention_problem,
    tpu_block_q,
    tpu_pages_per_block,
    tpu_q_sub_blocks,
)
from seer_jax.pallas.tree import kernel_tree_mask, token_seq_ids


def _dot_precision(dtype) -> jax.lax.Precision:
    """The kernel's dot precision, explicit so that a process-wide jax_default_matmul_precision
    cannot change it: bf16 operands multiply once on the MXU (Mosaic refuses "highest" for them:
    "Bad lhs type"), f32 operands at full f32 precision (as the GPU kernel, no TF32)."""
    return (jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32
            else jax.lax.Precision.DEFAULT)


def _kernel(
    # scalar prefetch (SMEM)
    layer_ref,  # [1]
    pages_ref,  # [max_seqs * pages_per_seq]
    kv_lens_ref,  # [max_seqs]
    cu_ref,  # [max_seqs + 1]
    blk_lo_ref,  # [num_blocks]
    blk_hi_ref,  # [num_blocks]
    # inputs
    q_ref,  # [Hkv, rows, D] (VMEM block)
    meta_ref,  # [rows, 4] int32: seq, qpos, vis_end, bits
    kv_hbm,  # [L, total_pages, page_size, 2 * Hkv, D] (HBM)
    # output
    o_ref,  # [Hkv, rows, D]
    # scratch
    kv_buf,  # [2, pages_per_block * page_size, 2 * Hkv, D]
    sems,  # DMA [2 slots]
    m_ref,  # [Hkv, rows, 1] f32
    l_ref,  # [Hkv, rows, 1] f32
    acc_ref,  # [Hkv, rows, D] f32
    *,
    sm_scale: float,
    block_q: int,
    sub_blocks: int,
    page_size: int,
    pages_per_block: int,
    pages_per_seq: int,
    has_tree: bool,
):
    b = pl.program_id(0)
    layer = layer_ref[0]
    num_kv_heads = q_ref.shape[0]
    sub_rows = q_ref.shape[1] // sub_blocks
    kv_blk = pages_per_block * page_size
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    start, wait = page_block_dma(pages_ref, kv_hbm, kv_buf, sems, layer,
                                 pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
                                 page_size=page_size)
    first_sub = b * sub_blocks  # the block's first sub-block of `block_q` tokens

    def per_seq(seq, carry):
        # the keys any row of seq in this block sees: each KV block is fetched once for all of
        # the block's sub-blocks
        kv_end = visible_kv_end(seq, b, block_q * sub_blocks, kv_lens_ref, cu_ref)
        n_pages = pl.cdiv(kv_end, page_size)
        n_kb = pl.cdiv(kv_end, kv_blk)
        # the sub-blocks holding rows of seq
        sub_lo = jnp.maximum(jax.lax.div(cu_ref[seq], block_q), first_sub) - first_sub
        sub_hi = jnp.minimum(pl.cdiv(cu_ref[seq + 1], block_q), first_sub + sub_blocks) - first_sub

        @pl.when(n_kb > 0)
        def _():
            start(seq, 0, 0, n_pages)

        def per_kv_block(kb, c):
            slot = kb % 2

            @pl.when(kb + 1 < n_kb)
            def _():
                start(seq, kb + 1, 1 - slot, n_pages)

            wait(seq, kb, slot, n_pages)
            kpos_col, kpos = iota_positions(kb, kv_blk)
            buf = kv_buf.at[slot]

            def per_sub(j, c2):
                # a sub-block multiplies only the KV blocks its own rows can see
                sub_end = visible_kv_end(seq, first_sub + j, block_q, kv_lens_ref, cu_ref)

                @pl.when(kb * kv_blk < sub_end)
                def _():
                    r = pl.ds(pl.multiple_of(j * sub_rows, sub_rows), sub_rows)
                    meta = meta_ref[r, :]
                    row_seq, row_qpos, row_vis, row_bits = (meta[:, i: i + 1] for i in range(4))
                    # [sub_rows, kv_blk], every head
                    mask = key_mask(kpos, sub_end, row_seq == seq, row_vis, row_qpos, row_bits,
                                    has_tree)
                    for h in range(num_kv_heads):
                        k = buf[:, 2 * h, :]  # [kv_blk, D] cache dtype
                        prec = _dot_precision(k.dtype)
                        v = buf[:, 2 * h + 1, :]
                        # stale / NaN rows never leak
                        v = jnp.where(kpos_col < kv_end, v, jnp.zeros_like(v))
                        q = (q_ref[h, r, :].astype(jnp.float32) * sm_scale).astype(k.dtype)
                        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                                                preferred_element_type=jnp.float32)
                        p, alpha, m_ref[h, r, :], l_ref[h, r, :] = online_softmax_step(
                            s, mask, m_ref[h, r, :], l_ref[h, r, :])
                        acc_ref[h, r, :] = alpha * acc_ref[h, r, :] + jnp.dot(
                            p.astype(v.dtype), v, precision=prec,
                            preferred_element_type=jnp.float32)

                return c2

            jax.lax.fori_loop(sub_lo, sub_hi, per_sub, 0)
            return c

        jax.lax.fori_loop(0, n_kb, per_kv_block, 0)
        return carry

    jax.lax.fori_loop(blk_lo_ref[b], blk_hi_ref[b], per_seq, 0)
    den = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(den > 0, den, 1.0)).astype(o_ref.dtype)


def row_metadata(tree_parents, cu_q_lens, kv_lens, num_seqs, num_tokens):
    """Per-token (seq, qpos, vis_end, bits, exact): seq -1 for padding; positions absolute."""
    cu = cu_q_lens.astype(jnp.int32)
    seq = token_seq_ids(cu, num_seqs, num_tokens)
    seq_c = jnp.maximum(seq, 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    rel = t - cu[seq_c]
    ctx = kv_lens[seq_c] - (cu[seq_c + 1] - cu[seq_c])
    vis_len, bits, exact = kernel_tree_mask(tree_parents, cu, num_seqs, num_tokens)
    return seq, ctx + rel, ctx + vis_len, bits, exact


def block_seq_ranges(cu_q_lens, num_seqs, num_blocks: int, block_q: int):
    """[lo, hi) range of live sequences with tokens in each q block."""
    ends = cu_q_lens[1:]
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    lo = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    hi = jnp.searchsorted(ends, starts + block_q - 1, side="right").astype(jnp.int32) + 1
    n = jnp.asarray(num_seqs, jnp.int32).reshape(())
    return jnp.minimum(lo, n), jnp.minimum(hi, n)


def prepare(q, num_kv_heads, page_size, kv_lens, page_indices, cu_q_lens, num_seqs,
            tree_parents, block_q, group_pad: int = 1):
    """Shared wrapper work for both kernels: padded, head-folded q and per-row metadata.

    Returns (q_rows [Hkv, Tp*Gp, D], meta [Tp*Gp, 4], kv_lens (clamped), bad_tok [T],
    blk_lo, blk_hi, Tp, Gp).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    gp = -(-group // group_pad) * group_pad
    tp = -(-num_tokens // block_q) * block_q
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    cu = cu_q_lens.astype(jnp.int32)
    kv = kv_lens.astype(jnp.int32)
    live = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    bad_seq = live & ((kv > pages_per_seq * page_size) | (kv < q_lens))
    kv = jnp.where(bad_seq, jnp.minimum(jnp.maximum(kv, q_lens), pages_per_seq * page_size), kv)
    kv = jnp.where(live, kv, 0)
    seq, qpos, vis_end, bits, exact = row_metadata(tree_parents, cu, kv, num_seqs, num_tokens)
    bad_tok = (seq >= 0) & (bad_seq[jnp.maximum(seq, 0)] | ~exact)
    meta = jnp.stack([seq, qpos, vis_end, bits], axis=1)  # [T, 4]
    meta = jnp.pad(meta, ((0, tp - num_tokens), (0, 0)), constant_values=-1)
    meta = jnp.repeat(meta, gp, axis=0)  # rows are token-major, head-minor
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q4 = jnp.pad(q4, ((0, tp - num_tokens), (0, 0), (0, gp - group), (0, 0)))
    q_rows = jnp.transpose(q4, (1, 0, 2, 3)).reshape(num_kv_heads, tp * gp, head_dim)
    blk_lo, blk_hi = block_seq_ranges(cu, num_seqs, tp // block_q, block_q)
    return q_rows, meta, kv, bad_tok, blk_lo, blk_hi, tp, gp


def unfold(o_rows, num_tokens, num_q_heads, group, gp, bad_tok, dtype):
    """[Hkv, Tp*Gp, D] rows back to [T, Hq, D]; NaN for tokens the kernel could not serve."""
    num_kv_heads, _, head_dim = o_rows.shape
    o = o_rows.reshape(num_kv_heads, -1, gp, head_dim)[:, :num_tokens, :group]
    o = jnp.transpose(o, (1, 0, 2, 3)).reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(bad_tok[:, None, None], jnp.nan, o).astype(dtype)


def ragged_paged_attention_tpu(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    sm_scale: float | None = None,
    tree_parents: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    layer: jax.Array | int | None = None,
    sub_blocks: int | None = None,
) -> jax.Array:
    """TPU kernel; same contract as `seer_jax.pallas.ragged_paged_attention`.

    kv_pages: [P, S, 2 * Hkv, D], or the whole cache [L, P, S, 2 * Hkv, D] with `layer`.
    interpret=True runs the TPU simulator (`pltpu.InterpretParams()`) on CPU. block_q: tokens
    per sub-block (the rows multiplied together); sub_blocks: sub-blocks per q block (sharing
    each K/V fetch); both default to `limits`' choices.
    """
    kv5, layer_arr = pool_5d(kv_pages, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, total_pages, page_size, combined, _ = kv5.shape
    num_kv_heads = combined // 2
    max_seqs, pages_per_seq = page_indices.shape
    dtype_bytes = jnp.dtype(kv5.dtype).itemsize
    problem = tpu_attention_problem(
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, dtype_bytes=dtype_bytes, max_seqs=max_seqs,
        pages_per_seq=pages_per_seq, num_tokens=num_tokens)
    if problem:
        raise InputError(f"TPU attention kernel cannot lower: {problem}; use impl='reference'")
    group = num_q_heads // num_kv_heads
    block_q = tpu_block_q(group, block_q)
    pages_per_block = tpu_pages_per_block(num_kv_heads=num_kv_heads, head_dim=head_dim,
                                          page_size=page_size, dtype_bytes=dtype_bytes,
                                          pages_per_seq=pages_per_seq, requested=pages_per_block)
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    sub_blocks = tpu_q_sub_blocks(num_tokens=num_tokens, block_q=block_q, rows_per_token=group,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  q_bytes=q.dtype.itemsize, requested=sub_blocks)
    grid_q = block_q * sub_blocks  # tokens per q block
    q_rows, meta, kv, bad_tok, blk_lo, blk_hi, tp, gp = prepare(
        q, num_kv_heads, page_size, kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents,
        grid_q)
    rows = grid_q * gp
    num_blocks = tp // grid_q
    kv_blk = pages_per_block * page_size
    kernel = functools.partial(
        _kernel, sm_scale=scale, block_q=block_q, sub_blocks=sub_blocks, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
        has_tree=tree_parents is not None,
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_blocks,),
        in_specs=[
            pl.BlockSpec((num_kv_heads, rows, head_dim), lambda b, *_: (0, b, 0)),
            pl.BlockSpec((rows, 4), lambda b, *_: (b, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((num_kv_heads, rows, head_dim), lambda b, *_: (0, b, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, kv_blk, combined, head_dim), kv5.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    o_rows = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=attention_cost(
            num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype_bytes=dtype_bytes, q_bytes=q.dtype.itemsize,
            max_seqs=max_seqs, pages_per_seq=pages_per_seq, page_size=page_size,
            total_pages=total_pages, block_q=grid_q, kv_block=kv_blk,
            compute_block_q=block_q, kernel="seer_ragged_paged_attention_tpu"),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="seer_ragged_paged_attention_tpu",
    )(
        layer_arr, page_indices.astype(jnp.int32).reshape(-1), kv, cu_q_lens.astype(jnp.int32),
        blk_lo, blk_hi, q_rows, meta, kv5,
    )
    return unfold(o_rows, num_tokens, num_q_heads, group, gp, bad_tok, q.dtype)
