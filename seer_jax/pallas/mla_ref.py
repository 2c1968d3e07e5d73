"""Pure-jnp ragged paged MLA attention and latent write (the references the kernels match).

Absorbed form: the caller has multiplied each head's no-RoPE query into the latent space
(q_latent [T, H, kv_lora_rank]) and keeps its RoPE part (q_rope [T, H, qk_rope_head_dim]). With
a token's cache row = [c_kv, k_rope] (`mla_layout`), the score of query head h against key j is
`sm_scale * (q_latent[h] . c_kv[j] + q_rope[h] . k_rope[j])` and the output is the softmax-weighted
sum of c_kv rows, in the latent space [T, H, kv_lora_rank]; the value up-projection follows
outside. Masking (causal offset kv_len - q_len, draft trees, padding) is the dense attention's
(`attention_ref`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from seer_jax.pallas.attention_ref import query_block
from seer_jax.pallas.tree import TokenForest, token_seq_ids


def mla_attention_reference(
    q_latent: jax.Array,  # [num_tokens, num_heads, kv_lora_rank]
    q_rope: jax.Array,  # [num_tokens, num_heads, qk_rope_head_dim]
    latent_pages: jax.Array,  # [total_pages, page_size, kv_lora_rank + qk_rope_head_dim]
    kv_lens: jax.Array,  # [max_seqs] int32, includes the new tokens
    page_indices: jax.Array,  # [max_seqs, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [max_seqs + 1] int32
    num_seqs: jax.Array,  # [] int32
    *,
    sm_scale: float,
    tree_parents: jax.Array | None = None,
    max_q_len: int | None = None,
    layer: jax.Array | int | None = None,  # with a [L, P, S, W] cache: the layer
) -> jax.Array:
    """MLA over the paged latent cache -> [num_tokens, num_heads, kv_lora_rank] in q's dtype.

    Tokens beyond cu_q_lens[num_seqs] get zeros; a sequence whose kv_len exceeds its page-table
    capacity (or is below its q_len) gets NaN rows.
    """
    num_tokens, num_heads, rank = q_latent.shape
    total_pages, page_size, _ = latent_pages.shape[-3:]
    max_seqs, pages_per_seq = page_indices.shape
    qm = num_tokens if max_q_len is None else max(1, min(int(max_q_len), num_tokens))
    kv_cap = pages_per_seq * page_size
    num_seqs = jnp.asarray(num_seqs, jnp.int32).reshape(())
    cu = cu_q_lens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)

    live = jnp.arange(max_seqs) < num_seqs
    q_lens = jnp.where(live, cu[1:] - cu[:-1], 0)
    ctx = kv_lens - q_lens
    bad_seq = live & ((kv_lens > kv_cap) | (ctx < 0))

    slot = jnp.arange(qm, dtype=jnp.int32)
    tok = cu[:-1, None] + slot[None, :]  # [S, qm]
    q_valid = slot[None, :] < q_lens[:, None]
    tok_c = jnp.clip(tok, 0, num_tokens - 1)
    ql_s = jnp.take(q_latent, tok_c, axis=0).astype(jnp.float32)  # [S, qm, H, R]
    qr_s = jnp.take(q_rope, tok_c, axis=0).astype(jnp.float32)  # [S, qm, H, Dr]

    pages = jnp.clip(page_indices, 0, total_pages - 1)
    rows = latent_pages[pages] if layer is None else latent_pages[layer, pages]  # [S,pps,ps,W]
    row_major = Layout(major_to_minor=tuple(range(rows.ndim)))
    rows = jax.lax.platform_dependent(
        rows, tpu=lambda x: with_layout_constraint(x, row_major), default=lambda x: x)
    rows = rows.reshape(max_seqs, kv_cap, -1)
    kpos = jnp.arange(kv_cap, dtype=jnp.int32)
    k_valid = kpos[None, :] < kv_lens[:, None]  # [S, L]
    # Zero what lies beyond kv_len: stale or NaN slots must not leak through 0 * NaN.
    rows = jnp.where(k_valid[:, :, None], rows, 0).astype(jnp.float32)
    c_kv, k_rope = rows[..., :rank], rows[..., rank:]

    if tree_parents is not None:
        seq = token_seq_ids(cu, num_seqs, num_tokens)
        forest = TokenForest(tree_parents, cu[jnp.maximum(seq, 0)])

    hi = jax.lax.Precision.HIGHEST

    def attend(ql_b, qr_b, slot_b):
        """Query slots slot_b ([qb]) of every sequence -> [S, qb, H, R]."""
        valid_b = slot_b[None, :] < q_lens[:, None]
        qpos = ctx[:, None] + slot_b[None, :]
        mask = ((kpos[None, None, :] <= qpos[:, :, None]) & k_valid[:, None, :]
                & valid_b[:, :, None])  # [S, qb, L]
        if tree_parents is not None:
            tb = jnp.clip(cu[:-1, None] + slot_b[None, :], 0, num_tokens - 1)
            anc = forest.is_ancestor_or_self(tb[:, :, None], tok_c[:, None, :])  # [S, qb, qm]
            rel = kpos[None, :] - ctx[:, None]  # [S, L] key index among the queries
            in_q = (rel >= 0) & (rel < qm)
            anc_l = jnp.take_along_axis(
                anc, jnp.broadcast_to(jnp.clip(rel, 0, qm - 1)[:, None, :],
                                      (max_seqs, slot_b.shape[0], kv_cap)), axis=2)
            mask = mask & ((rel[:, None, :] < 0) | (in_q[:, None, :] & anc_l))
        s = (jnp.einsum("sqhr,slr->shql", ql_b, c_kv, precision=hi)
             + jnp.einsum("sqhr,slr->shql", qr_b, k_rope, precision=hi)) * sm_scale
        m4 = mask[:, None, :, :]
        s = jnp.where(m4, s, -jnp.inf)
        row_max = jnp.max(s, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(m4, jnp.exp(s - row_max), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        return jnp.einsum("shql,slr->sqhr", p, c_kv, precision=hi)

    qb = query_block(max_seqs, qm, num_heads, kv_cap)
    if qb >= qm:
        o = attend(ql_s, qr_s, slot)
    else:
        nb = -(-qm // qb)

        def blocks(x):
            x = jnp.pad(x, ((0, 0), (0, nb * qb - qm), (0, 0), (0, 0)))
            return x.reshape(max_seqs, nb, qb, *x.shape[2:]).swapaxes(0, 1)

        slots = jnp.arange(nb * qb, dtype=jnp.int32).reshape(nb, qb)
        o = jax.lax.map(lambda a: attend(*a), (blocks(ql_s), blocks(qr_s), slots))
        o = o.swapaxes(0, 1).reshape(max_seqs, nb * qb, num_heads, rank)[:, :qm]
    o = jnp.where(bad_seq[:, None, None, None], jnp.nan, o)

    dest = jnp.where(q_valid, tok, num_tokens)  # padding slots scatter out of range (dropped)
    out = jnp.zeros((num_tokens, num_heads, rank), jnp.float32)
    out = out.at[dest.reshape(-1)].set(o.reshape(-1, num_heads, rank), mode="drop")
    return out.astype(q_latent.dtype)


def write_latent_reference(latent_pages, new_latent, new_rope, slot_mapping, layer=None):
    """Scatter token rows [c_kv, k_rope]; slots < 0 (or beyond the cache) are dropped. With
    `layer`, the pool is [L, P, S, W] and only that layer is written."""
    total_pages, page_size = latent_pages.shape[-3:-1]
    n_slots = total_pages * page_size
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots)
    pg, off = slots // page_size, slots % page_size
    new = jnp.concatenate([new_latent, new_rope], axis=-1).astype(latent_pages.dtype)
    if layer is not None:
        return latent_pages.at[layer, pg, off].set(new, mode="drop")
    return latent_pages.at[pg, off].set(new, mode="drop")
