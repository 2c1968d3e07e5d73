"""The attention estimates' causal bound holds for every length the step's shapes allow: a q
block reads each sequence it overlaps up to its last query (the kernels' `visible_kv_end`),
rounded up to whole KV blocks, and the bound is never below that, however the queries and
lengths fall; a prefill chunk's estimate takes it."""

from __future__ import annotations

import numpy as np
import pytest

from seer_jax.pallas.cost_estimates import _kv_reads, causal_kv_reads


def _kernel_reads(q_lens, kv_lens, block_q, kv_block):
    """Keys the kernels read for these sequences (queries packed in order, q blocks of block_q)."""
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    total = 0
    for b in range(-(-int(cu[-1]) // block_q)):
        for s in range(len(q_lens)):
            first, last = max(cu[s], b * block_q), min(cu[s + 1], (b + 1) * block_q)
            if last > first:
                end = min(kv_lens[s], kv_lens[s] - q_lens[s] + last - cu[s])
                total += -(-end // kv_block) * kv_block
    return total


@pytest.mark.parametrize("num_tokens, max_seqs, pages_per_seq, block_q", [
    (2048, 1, 32, 16), (512, 4, 64, 16), (256, 256, 128, 2), (300, 8, 20, 32), (64, 3, 8, 4)])
def test_kv_bound_covers_every_split_of_the_queries(num_tokens, max_seqs, pages_per_seq, block_q):
    page, kv_block = 16, 64
    T = pages_per_seq * page
    bound = causal_kv_reads(num_tokens=num_tokens, max_seqs=max_seqs, table=T,
                            block_q=block_q, kv_block=kv_block)
    rs = np.random.RandomState(num_tokens + max_seqs)
    worst = 0
    for trial in range(300):
        S = rs.randint(1, max_seqs + 1) if trial % 3 else max_seqs
        cuts = np.sort(rs.choice(np.arange(1, num_tokens), S - 1, replace=False)) if S > 1 else []
        q_lens = np.minimum(np.diff(np.concatenate([[0], cuts, [num_tokens]])), T)
        kv_lens = np.array([q if trial % 2 else rs.randint(q, T + 1) for q in q_lens])
        if trial % 5 == 0:
            kv_lens = np.full(S, T)
            q_lens = np.minimum(q_lens, T)
        worst = max(worst, _kernel_reads(q_lens, kv_lens, block_q, kv_block))
    assert worst <= bound


def test_prefill_bound_counts_about_half_the_full_tables():
    """One sequence whose 2,048 queries are its whole table: about half of what reading the table
    whole per q block would be (the causal window), and within a few percent of the reads."""
    reads, _ = _kv_reads(num_tokens=2048, max_seqs=1, pages_per_seq=32, page_size=64,
                         total_pages=32, block_q=16, kv_block=64)
    full = 2048 * 2048 // 16
    actual = _kernel_reads(np.array([2048]), np.array([2048]), 16, 64)
    assert actual <= reads < 0.56 * full and reads < 1.1 * actual
    assert reads == int(-(-causal_kv_reads(num_tokens=2048, max_seqs=1, table=2048, block_q=16,
                                            kv_block=64) // 1))
