"""TPU Pallas (Mosaic) ragged paged MLA attention, absorbed form.

The dense TPU kernel's scheme (`attention_tpu`) with one KV "head" shared by every query head:
grid (num_q_blocks,), a q block is `block_q` packed tokens x all heads as rows (token-major);
the page table, lengths and each block's sequence range come in by scalar prefetch (SMEM); the
latent cache ([P, S, W] or the whole [L, P, S, W] with a layer index, see `mla_layout`) stays in
HBM and each sequence's pages stream by async DMA, `pages_per_block` whole pages at a time, into
a double-buffered VMEM scratch. Per K/V block: scores = q_latent . c_kv^T + q_rope . k_rope^T
(two MXU dots, the rows' c_kv and k_rope are lane slices of the page rows), an online softmax in
f32 scratch, and acc += p . c_kv (the value is the latent itself, so one copy of each page feeds
both products). Only the pages a block's causal window needs are fetched; padding sequences and
tokens cost nothing. Row metadata (sequence, position, visible prefix, tree-window bits) is the
dense kernel's (`attention_tpu.prepare`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seer_jax.errors import InputError
from seer_jax.pallas.attention_tpu import _dot_precision, prepare, unfold
from seer_jax.pallas.cost_estimates import mla_cost
from seer_jax.pallas.kernel_parts import (
    NEG,
    iota_positions,
    key_mask,
    online_softmax_step,
    page_block_dma,
    visible_kv_end,
)
from seer_jax.pallas.limits import (
    TPU_KV_BLOCK_TOKENS,
    TPU_KV_BUFFER_BYTES,
    tpu_block_q,
    tpu_mla_problem,
)
from seer_jax.pallas.mla_layout import latent_pool_4d, padded_latent_bytes_per_token


def _kernel(
    # scalar prefetch (SMEM)
    layer_ref, pages_ref, kv_lens_ref, cu_ref, blk_lo_ref, blk_hi_ref,
    # inputs
    ql_ref,  # [rows, R] (VMEM block)
    qr_ref,  # [rows, Dr]
    meta_ref,  # [rows, 4] int32: seq, qpos, vis_end, bits
    kv_hbm,  # [L, total_pages, page_size, R + Dr] (HBM)
    # output
    o_ref,  # [rows, R]
    # scratch
    kv_buf,  # [2, pages_per_block * page_size, R + Dr]
    sems,  # DMA [2]
    m_ref, l_ref,  # [rows, 1] f32
    acc_ref,  # [rows, R] f32
    *, sm_scale: float, block_q: int, page_size: int, pages_per_block: int, pages_per_seq: int,
    rank: int, has_tree: bool,
):
    b = pl.program_id(0)
    layer = layer_ref[0]
    kv_blk = pages_per_block * page_size
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    meta = meta_ref[...]
    row_seq, row_qpos, row_vis, row_bits = (meta[:, i: i + 1] for i in range(4))
    cdt = kv_hbm.dtype
    prec = _dot_precision(cdt)
    ql = (ql_ref[...].astype(jnp.float32) * sm_scale).astype(cdt)
    qr = (qr_ref[...].astype(jnp.float32) * sm_scale).astype(cdt)

    start, wait = page_block_dma(pages_ref, kv_hbm, kv_buf, sems, layer,
                                 pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
                                 page_size=page_size)

    def per_seq(seq, carry):
        kv_end = visible_kv_end(seq, b, block_q, kv_lens_ref, cu_ref)
        n_pages = pl.cdiv(kv_end, page_size)
        n_kb = pl.cdiv(kv_end, kv_blk)

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
            # [rows, kv_blk]
            mask = key_mask(kpos, kv_end, row_seq == seq, row_vis, row_qpos, row_bits, has_tree)
            buf = kv_buf.at[slot]
            c_kv = buf[:, :rank]  # [kv_blk, R]
            k_rope = buf[:, rank:]  # [kv_blk, Dr]
            dims = (((1,), (1,)), ((), ()))
            s = (jax.lax.dot_general(ql, c_kv, dims, precision=prec,
                                     preferred_element_type=jnp.float32)
                 + jax.lax.dot_general(qr, k_rope, dims, precision=prec,
                                       preferred_element_type=jnp.float32))
            c_kv = jnp.where(kpos_col < kv_end, c_kv, jnp.zeros_like(c_kv))  # stale / NaN rows
            p, alpha, m_ref[...], l_ref[...] = online_softmax_step(s, mask, m_ref[...],
                                                                   l_ref[...])
            acc_ref[...] = alpha * acc_ref[...] + jnp.dot(
                p.astype(cdt), c_kv, precision=prec, preferred_element_type=jnp.float32)
            return c

        jax.lax.fori_loop(0, n_kb, per_kv_block, 0)
        return carry

    jax.lax.fori_loop(blk_lo_ref[b], blk_hi_ref[b], per_seq, 0)
    den = l_ref[...]
    o_ref[...] = (acc_ref[...] / jnp.where(den > 0, den, 1.0)).astype(o_ref.dtype)


def mla_attention_tpu(
    q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
    sm_scale: float,
    tree_parents: jax.Array | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """TPU kernel; same contract as `seer_jax.pallas.mla.ragged_paged_mla_attention`.
    interpret=True runs the TPU simulator (`pltpu.InterpretParams()`) on CPU."""
    pool, layer_arr = latent_pool_4d(latent_pages, layer)
    num_tokens, num_heads, rank = q_latent.shape
    rope_dim = q_rope.shape[-1]
    _, total_pages, page_size, width = pool.shape
    max_seqs, pages_per_seq = page_indices.shape
    dtype_bytes = jnp.dtype(pool.dtype).itemsize
    block_q = tpu_block_q(num_heads, block_q)
    problem = tpu_mla_problem(kv_lora_rank=rank, rope_dim=rope_dim, page_size=page_size,
                              dtype_bytes=dtype_bytes, max_seqs=max_seqs,
                              pages_per_seq=pages_per_seq, num_tokens=num_tokens,
                              block_q=block_q)
    if problem:
        raise InputError(f"TPU MLA kernel cannot lower: {problem}; use impl='reference'")
    if pages_per_block:
        pages_per_block = max(1, min(int(pages_per_block), pages_per_seq))
    else:
        page_bytes = page_size * padded_latent_bytes_per_token(rank, rope_dim, dtype_bytes)
        pages_per_block = max(1, min(TPU_KV_BLOCK_TOKENS // page_size,
                                     TPU_KV_BUFFER_BYTES // (2 * page_bytes), pages_per_seq))
    q = jnp.concatenate([q_latent, q_rope], axis=-1)  # [T, H, W]
    q_rows, meta, kv, bad_tok, blk_lo, blk_hi, tp, gp = prepare(
        q, 1, page_size, kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents, block_q)
    ql_rows, qr_rows = q_rows[0, :, :rank], q_rows[0, :, rank:]
    rows = block_q * gp
    num_blocks = tp // block_q
    kv_blk = pages_per_block * page_size
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), block_q=block_q, page_size=page_size,
        pages_per_block=pages_per_block, pages_per_seq=pages_per_seq, rank=rank,
        has_tree=tree_parents is not None)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(num_blocks,),
        in_specs=[
            pl.BlockSpec((rows, rank), lambda b, *_: (b, 0)),
            pl.BlockSpec((rows, rope_dim), lambda b, *_: (b, 0)),
            pl.BlockSpec((rows, 4), lambda b, *_: (b, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((rows, rank), lambda b, *_: (b, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, kv_blk, width), pool.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, rank), jnp.float32),
        ],
    )
    o_rows = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((tp * gp, rank), q_latent.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        cost_estimate=mla_cost(
            num_tokens=num_tokens, num_heads=num_heads, kv_lora_rank=rank, rope_dim=rope_dim,
            dtype_bytes=dtype_bytes, max_seqs=max_seqs, pages_per_seq=pages_per_seq,
            page_size=page_size, total_pages=total_pages, block_q=block_q,
            kv_block=pages_per_block * page_size, kernel="seer_mla_attention_tpu"),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="seer_mla_attention_tpu",
    )(
        layer_arr, page_indices.astype(jnp.int32).reshape(-1), kv, cu_q_lens.astype(jnp.int32),
        blk_lo, blk_hi, ql_rows, qr_rows, meta, pool,
    )
    return unfold(o_rows[None], num_tokens, num_heads, num_heads, gp, bad_tok, q_latent.dtype)
