"""In-kernel pieces the ragged paged attention kernels share, dense and latent, TPU and GPU:
the keys a q block's rows of one sequence may see, the split of those keys' blocks over KV
splits, the visibility mask (causal end and draft tree), one online-softmax step, and the TPU
kernels' double-buffered page DMAs. Each is traced inside a kernel body; the arrays are values
or refs of the kernel's own blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seer_jax.pallas.tree import KERNEL_TREE_WINDOW

NEG = -1e30  # the running max's start and the score of a masked key (finite: no inf - inf)


def visible_kv_end(seq, b, block_q: int, kv_lens_ref, cu_ref):
    """The end of the keys the rows of q block `b` that belong to sequence `seq` can see: they
    see positions < ctx + (last row - first query row of seq), at most the sequence's length;
    0 when the block holds none of its rows."""
    kv_len = kv_lens_ref[seq]
    q_start, q_end = cu_ref[seq], cu_ref[seq + 1]
    first = jnp.maximum(q_start, b * block_q)
    last = jnp.minimum(q_end, (b + 1) * block_q)  # exclusive
    ctx = kv_len - (q_end - q_start)
    return jnp.where(last > first, jnp.minimum(kv_len, ctx + last - q_start), 0)


def split_kv_blocks(kv_end, kv_blk: int, split, num_splits: int):
    """[lo, hi) of the KV blocks (of kv_blk keys) below kv_end that KV split `split` of
    `num_splits` reads: consecutive equal shares, the last ones possibly empty."""
    n_kb = pl.cdiv(kv_end, kv_blk)
    per_split = pl.cdiv(n_kb, num_splits)
    kb_lo = jnp.minimum(split * per_split, n_kb)
    return kb_lo, jnp.minimum(kb_lo + per_split, n_kb)


def key_mask(kpos, kv_end, in_seq, row_vis, row_qpos, row_bits, has_tree: bool):
    """[rows, keys] which keys each row attends: keys of its own sequence (`in_seq`, per row)
    below the block's end, and either before the row's visibility end (its context and causal
    prefix) or, in a draft tree, an ancestor within the last KERNEL_TREE_WINDOW positions (bit
    `back` of the row's tree bits). Row arrays are [rows, 1] and `kpos` [1, keys]."""
    vis = kpos < row_vis
    if has_tree:
        back = row_qpos - kpos
        in_win = (back >= 0) & (back < KERNEL_TREE_WINDOW)
        bit = (row_bits >> jnp.clip(back, 0, KERNEL_TREE_WINDOW - 1)) & 1
        vis = vis | (in_win & (bit == 1))
    return in_seq & vis & (kpos < kv_end)


def online_softmax_step(s, mask, m_prev, l_prev):
    """One block of keys into a running softmax: scores `s` [rows, keys] (f32) under `mask`,
    with the running max and denominator, [rows] or [rows, 1]. Returns (p, alpha, m_new,
    l_new): the block's unnormalised probabilities and the factor that rescales what was
    accumulated."""
    keep = m_prev.ndim == 2
    m_new = jnp.maximum(m_prev, jnp.max(jnp.where(mask, s, NEG), axis=1, keepdims=keep))
    p = jnp.where(mask, jnp.exp(s - (m_new if keep else m_new[:, None])), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    return p, alpha, m_new, alpha * l_prev + jnp.sum(p, axis=1, keepdims=keep)


def page_block_dma(pages_ref, hbm, buf, sems, layer, *, pages_per_block: int,
                   pages_per_seq: int, page_size: int):
    """(start, wait) of the async copies that bring KV block kb of sequence seq
    (`pages_per_block` pages of `hbm[layer]`, through the flat page table) into slot `slot` of
    the double buffer `buf`; pages at or past `n_pages` are neither copied nor waited on."""

    def copies(seq, kb, slot, n_pages):
        out = []
        for i in range(pages_per_block):
            page_no = kb * pages_per_block + i
            valid = page_no < n_pages
            page = pages_ref[seq * pages_per_seq + jnp.minimum(page_no, pages_per_seq - 1)]
            dst = pl.ds(i * page_size, page_size)
            out.append((valid, pltpu.make_async_copy(hbm.at[layer, page], buf.at[slot, dst],
                                                     sems.at[slot])))
        return out

    def start(seq, kb, slot, n_pages):
        for valid, cp in copies(seq, kb, slot, n_pages):
            pl.when(valid)(cp.start)

    def wait(seq, kb, slot, n_pages):
        for valid, cp in copies(seq, kb, slot, n_pages):
            pl.when(valid)(cp.wait)

    return start, wait


def iota_positions(kb, kv_blk: int):
    """Absolute key positions of KV block kb as a column [keys, 1] and a row [1, keys]."""
    col = kb * kv_blk + jax.lax.broadcasted_iota(jnp.int32, (kv_blk, 1), 0)
    row = kb * kv_blk + jax.lax.broadcasted_iota(jnp.int32, (1, kv_blk), 1)
    return col, row
