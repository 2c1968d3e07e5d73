"""Decode attention over the paged KV cache, shaped for XLA on CPU.

The engine's decode region has one query token per sequence. The jnp reference
(`seer_jax.pallas.attention_ref`) gathers every sequence's whole page-table row
([max_seqs, pages_per_seq * page_size, 2 * num_kv_heads, head_dim]) and runs a dense masked softmax
over it, so each layer materialises and re-reads the padded K/V of the batch. Here a
`while_loop` walks the page tables a few pages at a time with an online (flash-decoding style)
softmax: each block's K/V is gathered into a small buffer that stays in cache, and the loop stops
after the longest live sequence, so the page-table width (pages_per_seq) costs nothing and need
not be bucketed.

Same contract as `ragged_paged_attention` restricted to q_len == 1 for every live sequence
(decode; no tree): token i is sequence i's query, sitting at position kv_lens[i] - 1. Sequences
i >= num_seqs produce zeros. Inputs are assumed valid (the public entry point checks them); K/V
slots beyond a sequence's kv_len are masked out and never leak (also when they hold NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seer_jax.pallas.kv_layout import split_kv


def gather_pages(kv_pages: jax.Array, idx: jax.Array,
                 layer: jax.Array | int | None = None) -> jax.Array:
    """kv_pages[idx] of a [P, S, C, D] pool, or kv_pages[layer, idx] of a [L, P, S, C, D] cache
    (one gather of whole page rows, no per-layer copy) -> [*idx.shape, S, C, D]."""
    return kv_pages[idx] if layer is None else kv_pages[layer, idx]


def paged_decode_attention(
    q: jax.Array,  # [max_seqs, num_q_heads, head_dim], one query token per sequence slot
    kv_pages: jax.Array,  # [total_pages, page_size, 2 * num_kv_heads, head_dim] (or [L, ...])
    kv_lens: jax.Array,  # [max_seqs] int32, including the query token
    page_indices: jax.Array,  # [max_seqs, pages_per_seq] int32
    num_seqs: jax.Array,  # [] int32
    *,
    layer: jax.Array | int | None = None,
    sm_scale: float | None = None,
    pages_per_block: int = 2,
    rows: jax.Array | None = None,
) -> jax.Array:
    """Attention of one query per sequence over its paged K/V -> [max_seqs, num_q_heads, head_dim].

    With `layer`, kv_pages is the whole cache [num_layers, total_pages, page_size,
    2 * num_kv_heads, head_dim] and the pages are gathered straight from it (slicing one layer out of a
    large cache first would copy that layer's whole page pool on every call).
    With `rows` [max_seqs] int32, page_indices is a larger table [num_rows, pages_per_seq] and
    sequence i's page table is its row rows[i]: each block reads only its few entries of those
    rows, so nothing of size max_seqs x pages_per_seq is built.
    """
    max_seqs, num_q_heads, head_dim = q.shape
    total_pages, page_size, combined, _ = kv_pages.shape[-4:]
    num_kv_heads = combined // 2
    pps = page_indices.shape[1]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    ppb = max(1, min(int(pages_per_block), pps))
    blk = ppb * page_size
    n_blocks = -(-pps // ppb)

    live = jnp.arange(max_seqs) < jnp.asarray(num_seqs, jnp.int32).reshape(())
    kv_lens = jnp.where(live, kv_lens.astype(jnp.int32), 0)  # [S]
    if rows is None:
        pages = jnp.clip(page_indices.astype(jnp.int32), 0, total_pages - 1)
        pages = jnp.pad(pages, ((0, 0), (0, n_blocks * ppb - pps)))  # [S, n_blocks * ppb]

        def block_pages(j):  # [S, ppb]
            return jax.lax.dynamic_slice_in_dim(pages, j * ppb, ppb, axis=1)
    else:
        seq_rows = rows.astype(jnp.int32)[:, None]  # [S, 1]

        def block_pages(j):  # [S, ppb]; columns past pps repeat the last (masked by kv_lens)
            cols = jnp.minimum(j * ppb + jnp.arange(ppb, dtype=jnp.int32), pps - 1)
            return jnp.clip(page_indices[seq_rows, cols[None, :]].astype(jnp.int32),
                            0, total_pages - 1)
    # [S, Hkv, G, D] against K/V blocks [S, blk, Hkv, D] (the cache's token-major rows).
    q_k = (q.astype(jnp.float32) * scale).reshape(max_seqs, num_kv_heads, group, head_dim)
    n_iter = jnp.minimum((jnp.max(kv_lens) + blk - 1) // blk, n_blocks)

    def body(carry):
        j, m, denom, acc = carry
        pg = block_pages(j)  # [S, ppb]
        kv = gather_pages(kv_pages, pg, layer).reshape(max_seqs, blk, combined, head_dim)
        k, v = split_kv(kv.astype(jnp.float32))  # [S, blk, Hkv, D]
        valid = (j * blk + jnp.arange(blk))[None, :] < kv_lens[:, None]  # [S, blk]
        v = jnp.where(valid[:, :, None, None], v, 0.0)
        s = jnp.einsum("skgd,slkd->skgl", q_k, k)
        s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [S, Hkv, G]
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        denom = denom * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("skgl,slkd->skgd", p, v)
        return j + 1, m_new, denom, acc

    shape = (max_seqs, num_kv_heads, group)
    init = (jnp.int32(0), jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < n_iter, body, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]  # [S, Hkv, G, D]
    out = out.reshape(max_seqs, num_q_heads, head_dim)
    return out.astype(q.dtype)
