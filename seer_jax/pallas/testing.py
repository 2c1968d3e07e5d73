"""Test/benchmark helpers: build ragged paged batches and a naive dense attention (NumPy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PagedBatch:
    q: np.ndarray  # [num_tokens, Hq, D]
    kv_pages: np.ndarray  # [total_pages, page_size, 2 * Hkv, D] (see seer_jax.pallas.kv_layout)
    kv_lens: np.ndarray  # [max_seqs] int32
    page_indices: np.ndarray  # [max_seqs, pages_per_seq] int32
    cu_q_lens: np.ndarray  # [max_seqs + 1] int32
    num_seqs: np.ndarray  # [] int32
    tree_parents: np.ndarray | None  # [num_tokens] int32

    def args(self):
        return (self.q, self.kv_pages, self.kv_lens, self.page_indices, self.cu_q_lens,
                self.num_seqs)

    @property
    def k_pages(self) -> np.ndarray:  # [total_pages, page_size, Hkv, D]
        return self.kv_pages[..., 0::2, :]

    @property
    def v_pages(self) -> np.ndarray:
        return self.kv_pages[..., 1::2, :]


@dataclass
class RaggedLayout:
    """Where a random ragged batch's sequences live: shuffled pages per sequence (padding table
    entries point at a page no sequence uses), lengths, query offsets, tree parents."""

    seq_pages: list[np.ndarray]
    total_pages: int
    num_tokens: int
    table: np.ndarray  # [max_seqs, pages_per_seq] int32
    kv_lens: np.ndarray  # [max_seqs] int32
    cu_q_lens: np.ndarray  # [max_seqs + 1] int32
    parents: np.ndarray  # [num_tokens] int32, relative parents (chains when no tree is given)


def ragged_layout(seqs: list[tuple[int, int]], rng: np.random.Generator, *, page_size: int,
                  max_seqs: int | None, pages_per_seq: int | None, num_tokens: int | None,
                  extra_pages: int, trees: dict[int, list[int]] | None) -> RaggedLayout:
    """The page tables and offsets of a batch of (q_len, kv_len) sequences (one permutation
    drawn from rng)."""
    max_seqs = max_seqs or len(seqs)
    need = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = pages_per_seq or max(need + [1])
    total_pages = sum(need) + extra_pages
    num_tokens = num_tokens or sum(ql for ql, _ in seqs)
    perm = rng.permutation(total_pages)
    table = np.full((max_seqs, pages_per_seq), perm[-1], np.int32)  # a page no sequence uses
    kv_lens = np.zeros(max_seqs, np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    parents = np.full(num_tokens, -1, np.int32)
    seq_pages, nxt = [], 0
    for s, (ql, kv_len) in enumerate(seqs):
        seq_pages.append(perm[nxt: nxt + need[s]])
        nxt += need[s]
        table[s, : need[s]] = seq_pages[-1]
        kv_lens[s] = kv_len
        cu[s + 1] = cu[s] + ql
        parents[cu[s]: cu[s + 1]] = list(range(-1, ql - 1)) if not trees or s not in trees else trees[s]
    cu[len(seqs) + 1:] = cu[len(seqs)]
    return RaggedLayout(seq_pages, total_pages, num_tokens, table, kv_lens, cu, parents)


def visible_keys(kv_len: int, q_len: int, i: int, parents: np.ndarray | None) -> np.ndarray:
    """[kv_len] bool: the keys query i of a sequence's last q_len positions sees (its context,
    then itself and its ancestors: the causal chain, or the tree of relative `parents`)."""
    ctx = kv_len - q_len
    vis = np.zeros(kv_len, bool)
    vis[:ctx] = True
    if parents is None:
        vis[ctx: ctx + i + 1] = True
        return vis
    j = i
    while j >= 0:
        vis[ctx + j] = True
        j = int(parents[j]) if 0 <= parents[j] < j else -1
    return vis


def make_batch(
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per live sequence
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_seqs: int | None = None,
    pages_per_seq: int | None = None,
    num_tokens: int | None = None,
    extra_pages: int = 3,
    dtype=np.float32,
    trees: dict[int, list[int]] | None = None,  # seq index -> relative parents of its queries
    seed: int = 0,
) -> PagedBatch:
    """Random batch; pages not used by any live sequence (and slots past kv_len) hold NaN,
    page tables point at shuffled pages, padding table entries point at a NaN page."""
    rng = np.random.default_rng(seed)
    lay = ragged_layout(seqs, rng, page_size=page_size, max_seqs=max_seqs,
                        pages_per_seq=pages_per_seq, num_tokens=num_tokens,
                        extra_pages=extra_pages, trees=trees)
    num_tokens = lay.num_tokens
    kv = np.full((lay.total_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    for pages, (_, kv_len) in zip(lay.seq_pages, seqs, strict=True):
        for i in range(kv_len):
            page, off = pages[i // page_size], i % page_size
            kv[page, off, 0::2] = rng.normal(size=(num_kv_heads, head_dim))  # K
            kv[page, off, 1::2] = rng.normal(size=(num_kv_heads, head_dim))  # V
    q = rng.normal(size=(num_tokens, num_q_heads, head_dim)).astype(np.float32)
    return PagedBatch(
        q.astype(dtype), kv.astype(dtype), lay.kv_lens, lay.table, lay.cu_q_lens,
        np.int32(len(seqs)), lay.parents if trees else None,
    )


def naive_attention(b: PagedBatch, sm_scale: float | None = None) -> np.ndarray:
    """Dense attention per sequence over its gathered pages, float64, zeros for padding."""
    num_tokens, hq, d = b.q.shape
    _, page_size, hkv, _ = b.k_pages.shape
    g = hq // hkv
    scale = d**-0.5 if sm_scale is None else sm_scale
    out = np.zeros((num_tokens, hq, d), np.float64)
    q = b.q.astype(np.float64)
    for s in range(int(b.num_seqs)):
        lo, hi = int(b.cu_q_lens[s]), int(b.cu_q_lens[s + 1])
        ql, kv = hi - lo, int(b.kv_lens[s])
        kk = b.k_pages[b.page_indices[s]].reshape(-1, hkv, d)[:kv].astype(np.float64)
        vv = b.v_pages[b.page_indices[s]].reshape(-1, hkv, d)[:kv].astype(np.float64)
        par = None if b.tree_parents is None else b.tree_parents[lo:hi]
        for i in range(ql):
            vis = visible_keys(kv, ql, i, par)
            for h in range(hq):
                sc = kk[:, h // g][vis] @ q[lo + i, h] * scale
                p = np.exp(sc - sc.max())
                p /= p.sum()
                out[lo + i, h] = p @ vv[:, h // g][vis]
    return out
