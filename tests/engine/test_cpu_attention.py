"""CPU decode attention (online softmax over page blocks) vs the jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer_jax.engine.cpu_attention import gather_pages, paged_decode_attention
from seer_jax.pallas.attention_ref import ragged_paged_attention_reference
from seer_jax.pallas.kv_layout import interleave_kv


def make_case(rng, kv_lens, num_kv_heads, group, head_dim, page_size, pps, total_pages,
              max_seqs, nan_pages=False):
    """Random pools and page tables; unused pages hold NaN when nan_pages (a stray read shows).
    Returns (q, kv_pages [P, S, 2 * Hkv, D], kv_lens, table, cu, num_seqs)."""
    n = len(kv_lens)
    k = rng.standard_normal((num_kv_heads, total_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, total_pages, page_size, head_dim)).astype(np.float32)
    perm = rng.permutation(total_pages)
    table = np.zeros((max_seqs, pps), np.int32)
    used = 0
    for i, L in enumerate(kv_lens):
        need = -(-L // page_size)
        table[i, :need] = perm[used:used + need]
        used += need
    if nan_pages:
        unused = perm[used:]
        k[:, unused], v[:, unused] = np.nan, np.nan
        # the tail of each sequence's last page is stale too
        for i, L in enumerate(kv_lens):
            if L % page_size:
                last = table[i, (L - 1) // page_size]
                k[:, last, L % page_size:], v[:, last, L % page_size:] = np.nan, np.nan
    q = rng.standard_normal((max_seqs, num_kv_heads * group, head_dim)).astype(np.float32)
    kv = np.zeros(max_seqs, np.int32)
    kv[:n] = kv_lens
    cu = np.concatenate([np.arange(n + 1), np.full(max_seqs - n, n)]).astype(np.int32)
    pool = interleave_kv(k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3))
    return [jnp.asarray(x) for x in (q, pool, kv, table, cu)] + [jnp.int32(n)]


def reference(q, pool, kv, table, cu, n):
    return ragged_paged_attention_reference(q, pool, kv, table, cu, n, max_q_len=1)


@pytest.mark.parametrize("pages_per_block", [1, 2, 3, 8])
def test_decode_matches_reference_ragged_lengths(pages_per_block):
    rng = np.random.default_rng(0)
    kv_lens = [1, 5, 16, 17, 40, 63, 64, 3]
    case = make_case(rng, kv_lens, num_kv_heads=2, group=3, head_dim=16, page_size=8, pps=8,
                     total_pages=96, max_seqs=11, nan_pages=True)
    q, pool, kv, table, cu, n = case
    got = jax.jit(lambda *a: paged_decode_attention(*a, pages_per_block=pages_per_block))(
        q, pool, kv, table, n)
    want = reference(*case)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert np.all(np.asarray(got)[len(kv_lens):] == 0)  # padding slots give zeros


def test_layer_indexed_cache_equals_sliced_layer():
    rng = np.random.default_rng(1)
    kv_lens = [7, 30, 12]
    per_layer = [make_case(rng, kv_lens, 1, 4, 8, 4, 8, 40, 4) for _ in range(3)]
    kv_all = jnp.stack([c[1] for c in per_layer])
    q, _, kv, table, cu, n = per_layer[0]
    for layer in range(3):
        got = jax.jit(paged_decode_attention)(q, kv_all, kv, table, n, layer=jnp.int32(layer))
        want = reference(q, kv_all[layer], kv, table, cu, n)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    pg = table[:2, :3]
    np.testing.assert_array_equal(np.asarray(gather_pages(kv_all, pg, 2)),
                                  np.asarray(kv_all[2][pg]))


def test_zero_live_sequences_gives_zeros():
    rng = np.random.default_rng(2)
    q, pool, kv, table, cu, _ = make_case(rng, [4, 9], 1, 2, 8, 4, 4, 16, 4)
    got = paged_decode_attention(q, pool, kv, table, jnp.int32(0))
    assert np.all(np.asarray(got) == 0)


def test_bfloat16_cache_matches_reference():
    rng = np.random.default_rng(3)
    q, pool, kv, table, cu, n = make_case(rng, [3, 20, 33], 2, 2, 16, 8, 6, 24, 4)
    q, pool = q.astype(jnp.bfloat16), pool.astype(jnp.bfloat16)
    got = paged_decode_attention(q, pool, kv, table, n)
    want = reference(q, pool, kv, table, cu, n)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2, rtol=2e-2)


@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(1, 48), min_size=1, max_size=6), extra=st.integers(0, 3),
       page_size=st.sampled_from([1, 4, 16]), ppb=st.integers(1, 4), seed=st.integers(0, 2**16))
@pytest.mark.slow
def test_decode_matches_reference_property(lens, extra, page_size, ppb, seed):
    rng = np.random.default_rng(seed)
    pps = -(-max(lens) // page_size) + extra
    total = sum(-(-L // page_size) for L in lens) + 3
    case = make_case(rng, lens, 2, 2, 8, page_size, pps, total, len(lens) + 1, nan_pages=True)
    q, pool, kv, table, cu, n = case
    got = paged_decode_attention(q, pool, kv, table, n, pages_per_block=ppb)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(*case)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pages_per_block", [1, 2, 3])
def test_rows_of_a_larger_table_match_the_gathered_tables(pages_per_block):
    """`rows` picks each sequence's page table out of a persistent table (rows shuffled, more
    rows than sequences, odd width): the result is exactly that of the gathered tables."""
    rng = np.random.default_rng(3)
    kv_lens = [7, 40, 1, 33, 16]
    case = make_case(rng, kv_lens, num_kv_heads=2, group=2, head_dim=8, page_size=8, pps=7,
                     total_pages=64, max_seqs=7, nan_pages=True)
    q, pool, kv, table, cu, n = case
    order = rng.permutation(12)[:7].astype(np.int32)  # sequence i lives in row order[i]
    big = np.full((12, 7), 63, np.int32)  # other rows: a page nobody reads
    big[order] = np.asarray(table)
    want = paged_decode_attention(q, pool, kv, table, n, pages_per_block=pages_per_block)
    got = jax.jit(lambda *a: paged_decode_attention(*a[:5], pages_per_block=pages_per_block,
                                                    rows=a[5]))(
        q, pool, kv, jnp.asarray(big), n, jnp.asarray(order))
    np.testing.assert_array_equal(np.asarray(got)[:len(kv_lens)], np.asarray(want)[:len(kv_lens)])
