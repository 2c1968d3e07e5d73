"""Test/benchmark helpers for MLA: ragged batches over a paged latent cache, naive attention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seer_jax.pallas.testing import ragged_layout, visible_keys


@dataclass
class MlaBatch:
    q_latent: np.ndarray  # [num_tokens, H, kv_lora_rank]
    q_rope: np.ndarray  # [num_tokens, H, qk_rope_head_dim]
    latent_pages: np.ndarray  # [total_pages, page_size, kv_lora_rank + qk_rope_head_dim]
    kv_lens: np.ndarray  # [max_seqs] int32
    page_indices: np.ndarray  # [max_seqs, pages_per_seq] int32
    cu_q_lens: np.ndarray  # [max_seqs + 1] int32
    num_seqs: np.ndarray  # [] int32
    tree_parents: np.ndarray | None  # [num_tokens] int32

    def args(self):
        return (self.q_latent, self.q_rope, self.latent_pages, self.kv_lens, self.page_indices,
                self.cu_q_lens, self.num_seqs)


def make_mla_batch(
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per live sequence
    *,
    num_heads: int,
    kv_lora_rank: int,
    rope_dim: int,
    page_size: int,
    max_seqs: int | None = None,
    pages_per_seq: int | None = None,
    num_tokens: int | None = None,
    extra_pages: int = 3,
    dtype=np.float32,
    trees: dict[int, list[int]] | None = None,  # seq index -> relative parents of its queries
    seed: int = 0,
) -> MlaBatch:
    """Random batch; pages no live sequence uses (and slots past kv_len) hold NaN, page tables
    point at shuffled pages, padding table entries at a NaN page."""
    rng = np.random.default_rng(seed)
    lay = ragged_layout(seqs, rng, page_size=page_size, max_seqs=max_seqs,
                        pages_per_seq=pages_per_seq, num_tokens=num_tokens,
                        extra_pages=extra_pages, trees=trees)
    num_tokens = lay.num_tokens
    width = kv_lora_rank + rope_dim
    cache = np.full((lay.total_pages, page_size, width), np.nan, np.float32)
    for pages, (_, kv_len) in zip(lay.seq_pages, seqs, strict=True):
        rows = rng.normal(size=(len(pages) * page_size, width))
        for i in range(kv_len):
            cache[pages[i // page_size], i % page_size] = rows[i]
    ql = rng.normal(size=(num_tokens, num_heads, kv_lora_rank))
    qr = rng.normal(size=(num_tokens, num_heads, rope_dim))
    return MlaBatch(ql.astype(dtype), qr.astype(dtype), cache.astype(dtype), lay.kv_lens,
                    lay.table, lay.cu_q_lens, np.int32(len(seqs)), lay.parents if trees else None)


def naive_mla(b: MlaBatch, sm_scale: float) -> np.ndarray:
    """Dense MLA per sequence over its gathered rows, float64, zeros for padding tokens."""
    num_tokens, num_heads, rank = b.q_latent.shape
    out = np.zeros((num_tokens, num_heads, rank), np.float64)
    q = np.concatenate([b.q_latent, b.q_rope], axis=-1).astype(np.float64)
    for s in range(int(b.num_seqs)):
        lo, hi = int(b.cu_q_lens[s]), int(b.cu_q_lens[s + 1])
        ql, kv = hi - lo, int(b.kv_lens[s])
        rows = b.latent_pages[b.page_indices[s]].reshape(-1, b.latent_pages.shape[-1])
        rows = rows[:kv].astype(np.float64)
        par = None if b.tree_parents is None else b.tree_parents[lo:hi]
        for i in range(ql):
            vis = visible_keys(kv, ql, i, par)
            sc = rows[vis] @ q[lo + i].T * sm_scale  # [keys, H]
            p = np.exp(sc - sc.max(axis=0))
            p /= p.sum(axis=0)
            out[lo + i] = p.T @ rows[vis, :rank]
    return out
