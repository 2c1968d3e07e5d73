"""GPU Pallas (Triton lowering) ragged paged attention with split-K.

Grid (num_q_blocks, num_kv_heads, num_kv_splits). Rows are `block_q` packed tokens x the padded
query-head group of one KV head (all block dims powers of two, as Triton requires). For each
sequence overlapping the q block, the split's share of the KV blocks the causal window needs is
read page-by-page through the page table (a gathered load of `pages_per_block` pages), with an
online softmax in registers. Each split writes its un-normalised accumulator and (m, l); the
wrapper merges the splits (split-K / flash-decoding), which keeps the GPU busy for decode batches
where there are few q blocks. With one split (prefill-sized batches) the kernel writes the
normalised output in q's dtype and there is nothing to merge. q, K and V stay in the cache dtype for the tensor cores (bf16 dots
accumulate in f32; f32 caches use full-precision dots, no TF32). The pool may be one layer
[P, S, 2 * Hkv, D] or the whole cache [L, P, S, 2 * Hkv, D] (see `kv_layout`) with a layer index
read inside the kernel, so the engine's layer scan never slices a layer out; a program reads its
head's K (combined head 2h) and V (2h + 1) rows by strided pointer loads. Pointer offsets are 64-bit whenever an
array exceeds 4 GiB (the Triton lowering picks the width per array). Row metadata and the tree mask are shared with the TPU kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from seer_jax.errors import InputError
from seer_jax.pallas.attention_tpu import prepare, unfold
from seer_jax.pallas.cost_estimates import attention_cost
from seer_jax.pallas.kernel_parts import (
    NEG,
    key_mask,
    online_softmax_step,
    split_kv_blocks,
    visible_kv_end,
)
from seer_jax.pallas.kv_layout import pool_5d
from seer_jax.pallas.limits import gpu_attention_problem, pow2


def _kernel(
    q_ref,  # [rows, D]
    meta_ref,  # [rows, 4]
    k_ref,  # [L, total_pages, page_size, D] (this KV head's K, every layer)
    v_ref,  # [L, total_pages, page_size, D] (its V)
    layer_ref,  # [1]
    pages_ref,  # [max_seqs, pages_per_seq_padded]
    kv_lens_ref,  # [max_seqs]
    cu_ref,  # [max_seqs + 1]
    blk_lo_ref,  # [num_blocks]
    blk_hi_ref,  # [num_blocks]
    o_ref,  # [rows, D] f32 (this split)
    m_out_ref,  # [rows] f32
    l_out_ref,  # [rows] f32
    *,
    sm_scale: float,
    block_q: int,
    page_size: int,
    pages_per_block: int,
    num_splits: int,
    has_tree: bool,
):
    b = pl.program_id(0)
    split = pl.program_id(2)
    layer = layer_ref[0]
    rows, head_dim = q_ref.shape
    kv_blk = pages_per_block * page_size
    # f32 caches use full-precision dots (no TF32); bf16 caches bf16 dots with f32 accumulation.
    exact_f32 = False if k_ref.dtype == jnp.float32 else None
    q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(k_ref.dtype)
    # per row [rows, 1]: sequence, absolute position, visibility end, tree bits
    row_seq, row_qpos, row_vis, row_bits = (meta_ref[:, i][:, None] for i in range(4))

    def per_seq(seq, carry):
        kv_end = visible_kv_end(seq, b, block_q, kv_lens_ref, cu_ref)
        kb_lo, kb_hi = split_kv_blocks(kv_end, kv_blk, split, num_splits)
        in_seq = row_seq == seq

        def per_kv_block(kb, c):
            o, m, den = c
            pages = pages_ref[seq, pl.ds(kb * pages_per_block, pages_per_block)]
            k = k_ref[layer, pages].reshape(kv_blk, head_dim)
            v = v_ref[layer, pages].reshape(kv_blk, head_dim)
            kpos = kb * kv_blk + jnp.arange(kv_blk, dtype=jnp.int32)
            k_ok = kpos < kv_end
            v = jnp.where(k_ok[:, None], v, jnp.zeros_like(v))
            s = pltriton.dot(q, k, trans_b=True, allow_tf32=exact_f32)  # [rows, kv_blk] f32
            mask = key_mask(kpos[None, :], kv_end, in_seq, row_vis, row_qpos, row_bits, has_tree)
            p, alpha, m_new, den = online_softmax_step(s, mask, m, den)
            o = alpha[:, None] * o + pltriton.dot(p.astype(v.dtype), v, allow_tf32=exact_f32)
            return o, m_new, den

        return jax.lax.fori_loop(kb_lo, kb_hi, per_kv_block, carry)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    o, m, den = jax.lax.fori_loop(blk_lo_ref[b], blk_hi_ref[b], per_seq, init)
    if num_splits == 1:  # nothing to merge: the normalised output in q's dtype
        o = o / jnp.where(den > 0, den, 1.0)[:, None]
    o_ref[...] = o.astype(o_ref.dtype)
    m_out_ref[...] = m
    l_out_ref[...] = den


def ragged_paged_attention_gpu(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    sm_scale: float | None = None,
    tree_parents: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """GPU (Triton) kernel; same contract as `seer_jax.pallas.ragged_paged_attention`.

    kv_pages: [P, S, 2 * Hkv, D], or the whole cache [L, P, S, 2 * Hkv, D] with `layer`.

    num_kv_splits: KV splits per (q block, head) merged afterwards; default 4 for decode-like
    batches (num_tokens <= 2 * max_seqs), else 1.
    block_q: tokens per q block; default 16 rows of query heads for decode-like batches, 128 for
    prefill-sized ones.
    num_warps: default 8 for q blocks of 128 rows or more, else 4.
    """
    kv5, layer_arr = pool_5d(kv_pages, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, total_pages, page_size, combined, _ = kv5.shape
    num_kv_heads = combined // 2
    max_seqs, pages_per_seq = page_indices.shape
    problem = gpu_attention_problem(head_dim=head_dim, page_size=page_size)
    if problem:
        raise InputError(f"GPU attention kernel cannot lower: {problem}; use impl='reference'")
    group = num_q_heads // num_kv_heads
    gp = pow2(group)
    decode_like = num_tokens <= 2 * max_seqs
    if block_q is None:
        # 16 rows for decode-like batches (a token or a draft tree per sequence; the KV splits
        # keep the GPU busy), 128 for prefill-sized ones: each q block reads its sequences' KV
        # once, so a chunk's KV is read an eighth as often (the FlashAttention-2 Triton tile:
        # 128 query rows, 8 warps, a [128, D] float32 accumulator; 64 rows for heads wider than
        # 128, whose accumulator and q tile would not stay in registers)
        prefill_rows = 128 if head_dim <= 128 else 64
        block_q = max(1, (16 if decode_like else prefill_rows) // gp)
    block_q = pow2(block_q)
    if num_warps is None:
        num_warps = 8 if block_q * gp >= 128 else 4
    pages_per_block = pow2(pages_per_block or max(1, 64 // page_size))
    pages_per_block = min(pages_per_block, pow2(pages_per_seq))
    if num_kv_splits is None:
        num_kv_splits = 4 if decode_like else 1
    scale = head_dim**-0.5 if sm_scale is None else float(sm_scale)
    q_rows, meta, kv, bad_tok, blk_lo, blk_hi, tp, gp = prepare(
        q, num_kv_heads, page_size, kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents,
        block_q, group_pad=gp)
    rows = block_q * gp
    num_blocks = tp // block_q
    pps_pad = -(-pages_per_seq // pages_per_block) * pages_per_block
    pages = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pps_pad - pages_per_seq)))
    pages = jnp.clip(pages, 0, total_pages - 1)
    cu = cu_q_lens.astype(jnp.int32)
    kernel = functools.partial(
        _kernel, sm_scale=scale, block_q=block_q, page_size=page_size,
        pages_per_block=pages_per_block, num_splits=num_kv_splits,
        has_tree=tree_parents is not None,
    )
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))
    def pool(which: int):  # which 0: K (combined head 2h), 1: V (2h + 1)
        return pl.BlockSpec((num_layers, total_pages, page_size, None, head_dim),
                            lambda b, h, s: (0, 0, 0, 2 * h + which, 0))

    n_rows = tp * gp
    o, m, den = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, num_kv_splits),
        in_specs=[
            pl.BlockSpec((None, rows, head_dim), lambda b, h, s: (h, b, 0)),
            pl.BlockSpec((rows, 4), lambda b, h, s: (b, 0)),
            pool(0),
            pool(1),
            full((1,)),
            full(pages.shape),
            full(kv.shape),
            full(cu.shape),
            full(blk_lo.shape),
            full(blk_hi.shape),
        ],
        out_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (s, h, b, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h, s: (s, h, b)),
            pl.BlockSpec((None, None, rows), lambda b, h, s: (s, h, b)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_kv_splits, num_kv_heads, n_rows, head_dim),
                                 q.dtype if num_kv_splits == 1 else jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits, num_kv_heads, n_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_splits, num_kv_heads, n_rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        cost_estimate=attention_cost(
            num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, dtype_bytes=kv5.dtype.itemsize, q_bytes=q.dtype.itemsize,
            max_seqs=max_seqs, pages_per_seq=pages_per_seq, page_size=page_size,
            total_pages=total_pages, block_q=block_q, kv_block=pages_per_block * page_size,
            kernel="seer_ragged_paged_attention_gpu"),
        interpret=interpret,
        name="seer_ragged_paged_attention_gpu",
    )(q_rows, meta, kv5, kv5, layer_arr, pages, kv, cu, blk_lo, blk_hi)
    if num_kv_splits == 1:
        return unfold(o[0], num_tokens, num_q_heads, group, gp, bad_tok, q.dtype)
    # Merge the KV splits.
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(den * w, axis=0)
    o_all = jnp.sum(o * w[..., None], axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return unfold(o_all, num_tokens, num_q_heads, group, gp, bad_tok, q.dtype)
