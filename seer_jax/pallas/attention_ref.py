"""Pure-jnp ragged paged attention (the reference every kernel is tested against).

Sequence-major: each sequence's pages are gathered once through its page-table row
([max_seqs, pages_per_seq * page_size, 2 * num_kv_heads, head_dim], K and V interleaved), its queries are gathered into
[max_seqs, max_q_len] slots, and a masked dense softmax runs per sequence. The cost is
max_seqs * max_q_len * pages_per_seq * page_size, so pass `max_q_len` (static) when the batch is
known to be decode/verify only; the default (num_tokens) is always correct.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from seer_jax.pallas.kv_layout import split_kv
from seer_jax.pallas.tree import TokenForest, token_seq_ids

# Bytes of float32 attention scores one block of queries may hold (over every sequence, head
# and key): larger query regions run in blocks, so a long prefill chunk's scores never
# materialise whole (at a deployment's limits they would not fit the chip).
SCORE_BLOCK_BYTES = 256 << 20


def query_block(max_seqs: int, max_q_len: int, num_q_heads: int, kv_cap: int) -> int:
    """Query slots per block: all of them when their scores fit SCORE_BLOCK_BYTES, else the
    largest power of two that does (at least 1)."""
    per_slot = max_seqs * num_q_heads * kv_cap * 4
    if max_q_len * per_slot <= SCORE_BLOCK_BYTES:
        return max_q_len
    qb = 1
    while 2 * qb * per_slot <= SCORE_BLOCK_BYTES and 2 * qb < max_q_len:
        qb *= 2
    return qb


def ragged_paged_attention_reference(
    q: jax.Array,  # [num_tokens, num_q_heads, head_dim]
    kv_pages: jax.Array,  # [total_pages, page_size, 2 * num_kv_heads, head_dim]
    kv_lens: jax.Array,  # [max_seqs] int32, includes the new tokens
    page_indices: jax.Array,  # [max_seqs, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float | None = None,
    tree_parents: jax.Array | None = None,  # [num_tokens] int32, see seer_jax.pallas.tree
    max_q_len: int | None = None,
    layer: jax.Array | int | None = None,  # with a [L, P, S, 2*Hkv, D] cache: the layer
) -> jax.Array:
    """Attention of packed ragged queries over paged K/V -> [num_tokens, num_q_heads, head_dim].

    Tokens beyond cu_q_lens[num_seqs] get zeros. A sequence whose kv_len exceeds its page-table
    capacity (or is below its q_len) gets NaN rows, so a bad batch can never pass silently.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    total_pages, page_size, combined, _ = kv_pages.shape[-4:]
    num_kv_heads = combined // 2
    max_seqs, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    qm = num_tokens if max_q_len is None else max(1, min(int(max_q_len), num_tokens))
    kv_cap = pages_per_seq * page_size
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)

    live = jnp.arange(max_seqs) < num_seqs  # [S]
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)  # [S]
    ctx = kv_lens - q_lens  # [S] committed tokens before the queries
    bad_seq = live & ((kv_lens > kv_cap) | (ctx < 0))

    # Queries of each sequence into [S, qm] slots.
    slot = jnp.arange(qm, dtype=jnp.int32)
    tok = cu[:-1, None] + slot[None, :]  # [S, qm] packed token index
    q_valid = slot[None, :] < q_lens[:, None]
    q_s = jnp.take(q, jnp.clip(tok, 0, num_tokens - 1), axis=0)  # [S, qm, Hq, D]
    q_s = q_s.reshape(max_seqs, qm, num_kv_heads, group, head_dim).astype(jnp.float32)

    # K/V of each sequence through its page-table row.
    pages = jnp.clip(page_indices, 0, total_pages - 1)
    kv_s = kv_pages[pages] if layer is None else kv_pages[layer, pages]  # [S, pps, ps, C, D]
    # On TPU the gathered pages stay row-major, as the cache lies: otherwise XLA may give the
    # gather the head-major layout the score einsums prefer and feed it from a copy of the whole
    # cache in that tiling (4 combined K/V rows per shard); relaid out here, only these pages
    # move. Elsewhere XLA's own choice (on GPU it fuses the gather into its consumers).
    row_major = Layout(major_to_minor=tuple(range(kv_s.ndim)))
    kv_s = jax.lax.platform_dependent(
        kv_s, tpu=lambda x: with_layout_constraint(x, row_major), default=lambda x: x)
    kv_s = kv_s.reshape(max_seqs, kv_cap, 2 * num_kv_heads, head_dim)
    k_s, v_s = split_kv(kv_s)  # [S, L, Hkv, D]
    kpos = jnp.arange(kv_cap, dtype=jnp.int32)
    k_valid = kpos[None, :] < kv_lens[:, None]  # [S, L]
    # Zero what lies beyond kv_len: stale or NaN slots must not leak through 0 * NaN.
    v_s = jnp.where(k_valid[:, :, None, None], v_s, 0).astype(jnp.float32)
    k_s = k_s.astype(jnp.float32)

    if tree_parents is not None:
        seq = token_seq_ids(cu, num_seqs, num_tokens)
        forest = TokenForest(tree_parents, cu[jnp.maximum(seq, 0)])
        tok_c = jnp.clip(tok, 0, num_tokens - 1)  # [S, qm] every query of each sequence

    def attend(q_b, slot_b):
        """Queries in slots slot_b ([qb]) of every sequence: q_b [S, qb, Hkv, G, D] ->
        [S, qb, Hkv, G, D]."""
        tok_b = cu[:-1, None] + slot_b[None, :]  # [S, qb]
        valid_b = slot_b[None, :] < q_lens[:, None]
        qpos = ctx[:, None] + slot_b[None, :]  # [S, qb]
        mask = ((kpos[None, None, :] <= qpos[:, :, None]) & k_valid[:, None, :]
                & valid_b[:, :, None])
        if tree_parents is not None:
            # anc[s, i, j]: query j of sequence s is query i (of this block) or its ancestor.
            tb = jnp.clip(tok_b, 0, num_tokens - 1)
            anc = forest.is_ancestor_or_self(tb[:, :, None], tok_c[:, None, :])
            rel = kpos[None, :] - ctx[:, None]  # [S, L] key index among the queries
            in_q = (rel >= 0) & (rel < qm)
            anc_l = jnp.take_along_axis(
                anc, jnp.broadcast_to(jnp.clip(rel, 0, qm - 1)[:, None, :],
                                      (max_seqs, slot_b.shape[0], kv_cap)), axis=2)
            mask = mask & ((rel[:, None, :] < 0) | (in_q[:, None, :] & anc_l))
        s = jnp.einsum("sqkgd,slkd->skgql", q_b, k_s) * scale  # [S, Hkv, G, qb, L]
        m4 = mask[:, None, None, :, :]
        s = jnp.where(m4, s, -jnp.inf)
        row_max = jnp.max(s, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(m4, jnp.exp(s - row_max), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        return jnp.einsum("skgql,slkd->sqkgd", p, v_s)  # [S, qb, Hkv, G, D]

    qb = query_block(max_seqs, qm, num_q_heads, kv_cap)
    if qb >= qm:
        o = attend(q_s, slot)
    else:
        # the queries in blocks of qb slots, one block's scores live at a time
        nb = -(-qm // qb)
        q_p = jnp.pad(q_s, ((0, 0), (0, nb * qb - qm), (0, 0), (0, 0), (0, 0)))
        q_p = q_p.reshape(max_seqs, nb, qb, num_kv_heads, group, head_dim).swapaxes(0, 1)
        slots = jnp.arange(nb * qb, dtype=jnp.int32).reshape(nb, qb)
        o = jax.lax.map(lambda a: attend(*a), (q_p, slots))  # [nb, S, qb, Hkv, G, D]
        o = o.swapaxes(0, 1).reshape(max_seqs, nb * qb, num_kv_heads, group, head_dim)[:, :qm]
    o = jnp.where(bad_seq[:, None, None, None, None], jnp.nan, o)
    o = o.reshape(max_seqs, qm, num_q_heads, head_dim)

    dest = jnp.where(q_valid, tok, num_tokens)  # padding slots scatter out of range (dropped)
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = out.at[dest.reshape(-1)].set(o.reshape(-1, num_q_heads, head_dim), mode="drop")
    return out.astype(q.dtype)
