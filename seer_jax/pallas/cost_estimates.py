"""`pl.CostEstimate`s for the kernels, so the compiler's `cost_analysis()` counts them.

XLA cannot see into a Pallas call; without an estimate a compiled step reports no flops and no
bytes for attention or the KV write. Shapes are static, lengths are not, so the attention
estimate is for full page tables (`_kv_reads`): every sequence's table filled up to its capacity
(never more than the pool holds), each read once per q block that sequence spans, and at most
the bound that each q block reads a sequence's keys only up to the last query it holds (the
kernels' causal window), which a prefill chunk meets at about half the full tables' figure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class KernelEstimate:
    """One traced kernel call's estimate, with the kernel's pallas_call name."""

    kernel: str
    flops: int
    transcendentals: int
    bytes_accessed: int


# Open `collect()` blocks: each receives every estimate made while the block traces kernels.
_collectors: list[list[KernelEstimate]] = []


@contextlib.contextmanager
def collect():
    """Record the estimates of the kernels traced inside the block (a list of KernelEstimate,
    filled as they are traced). XLA:GPU's cost analysis does not see a Triton call's estimate; callers that count
    a GPU step's cost add these (`hardware.step.step_cost`)."""
    got: list[KernelEstimate] = []
    _collectors.append(got)
    try:
        yield got
    finally:
        _collectors.remove(got)


def _record(est: pl.CostEstimate, kernel: str) -> pl.CostEstimate:
    for got in _collectors:
        got.append(KernelEstimate(kernel, est.flops, est.transcendentals, est.bytes_accessed))
    return est


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def causal_kv_reads(*, num_tokens: int, max_seqs: int, table: int, block_q: int,
                    kv_block: int) -> float:
    """An upper bound on the keys the kernels read (summed over q blocks, one KV head) for
    num_tokens queries of at most max_seqs sequences of at most `table` keys each, over every way
    the queries and lengths can fall: a sequence whose C queries are its last C positions spans
    at most C / block_q + 2 q blocks, the i-th reading at most table - C + i * block_q keys (its
    last query's causal window) rounded up to a KV block, in all at most
    (C table - C^2 / 2) / block_q + 2 table + C / 2 + 3 block_q + (C / block_q + 2) kv_block;
    that is concave in C, so over sequences sharing the queries it is largest with the queries
    spread evenly over min(max_seqs, num_tokens) sequences."""
    S = max(1, min(max_seqs, num_tokens))
    C = min(num_tokens / S, table)
    return S * ((C * table - C * C / 2) / block_q + 2 * table + C / 2 + 3 * block_q
                + (C / block_q + 2) * kv_block)


def _kv_reads(*, num_tokens: int, max_seqs: int, pages_per_seq: int, page_size: int,
              total_pages: int, block_q: int, kv_block: int) -> tuple[int, int]:
    """(keys read summed over q blocks, keys attended summed over queries), one KV head: the
    smaller of two figures. Full tables: every sequence's table filled to its capacity (the
    tables together at most the pool), each read whole once per q block the sequence spans (the
    q blocks spread evenly over the sequences). Causal: `causal_kv_reads`, which a prefill chunk
    (many queries of one sequence) meets at about half the full tables' figure."""
    T = pages_per_seq * page_size
    pool_tokens = total_pages * page_size
    table_tokens = min(max_seqs * pages_per_seq, total_pages) * page_size
    num_blocks = _cdiv(num_tokens, block_q)
    full = table_tokens * max(1, _cdiv(num_blocks, max(1, min(num_blocks, max_seqs))))
    reads = min(full, math.ceil(causal_kv_reads(num_tokens=num_tokens, max_seqs=max_seqs,
                                                table=T, block_q=block_q, kv_block=kv_block)))
    # keys a query sees: its sequence's table, and all queries of a sequence share one pool;
    # the kernels score every row of a q block against every key the block reads
    attended = min(num_tokens * T, _cdiv(num_tokens, max(1, max_seqs)) * pool_tokens,
                   reads * block_q)
    return reads, attended


def attention_cost(*, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   dtype_bytes: int, q_bytes: int, max_seqs: int, pages_per_seq: int,
                   page_size: int, total_pages: int, block_q: int, kv_block: int,
                   kernel: str, compute_block_q: int | None = None) -> pl.CostEstimate:
    """Ragged paged attention of num_tokens queries over a [P, S, 2 * Hkv, D] pool (the
    pallas_call named `kernel`; q blocks of `block_q` tokens, KV read `kv_block` keys at a
    time; the keys multiplied by sub-blocks of `compute_block_q` tokens, default `block_q`)."""
    reads, attended = _kv_reads(num_tokens=num_tokens, max_seqs=max_seqs,
                                pages_per_seq=pages_per_seq, page_size=page_size,
                                total_pages=total_pages, block_q=block_q, kv_block=kv_block)
    if compute_block_q is not None and compute_block_q != block_q:
        _, attended = _kv_reads(num_tokens=num_tokens, max_seqs=max_seqs,
                                pages_per_seq=pages_per_seq, page_size=page_size,
                                total_pages=total_pages, block_q=compute_block_q,
                                kv_block=kv_block)
    kv_bytes = reads * 2 * num_kv_heads * head_dim * dtype_bytes
    q_out_bytes = 2 * num_tokens * num_q_heads * head_dim * q_bytes
    return _record(pl.CostEstimate(flops=4 * num_q_heads * head_dim * attended,
                                   transcendentals=num_q_heads * attended,
                                   bytes_accessed=kv_bytes + q_out_bytes), kernel)


def expert_gemm_cost(*, blocks: float, block_rows: int, rows: float, k_dim: int, n_dim: int,
                     matrices: int, in_bytes: int, w_bytes: int, out_bytes: int,
                     kernel: str) -> pl.CostEstimate:
    """`blocks` row blocks of `block_rows` rows holding `rows` real rows (the rest padding, which
    the kernel masks: no memory access), each block times `matrices` [k_dim, n_dim] weight
    matrices of its expert: the real rows read and their outputs written once, each block's
    expert matrices read once (as XLA counts a GEMM's operands); flops over whole blocks."""
    return _record(pl.CostEstimate(
        flops=int(2 * blocks * block_rows * k_dim * n_dim * matrices),
        transcendentals=int(rows * n_dim) if matrices == 2 else 0,
        bytes_accessed=int(rows * k_dim * in_bytes + blocks * matrices * k_dim * n_dim * w_bytes
                           + rows * n_dim * out_bytes)), kernel)


def write_cost(*, num_tokens: int, num_kv_heads: int, head_dim: int,
               dtype_bytes: int, kernel: str) -> pl.CostEstimate:
    """KV write: each token's [2 * Hkv, D] row read once, written once, plus its int32 slot."""
    row_bytes = num_tokens * 2 * num_kv_heads * head_dim * dtype_bytes
    return _record(pl.CostEstimate(flops=0, transcendentals=0,
                                   bytes_accessed=2 * row_bytes + 4 * num_tokens), kernel)


def mla_cost(*, num_tokens: int, num_heads: int, kv_lora_rank: int, rope_dim: int,
             dtype_bytes: int, max_seqs: int, pages_per_seq: int, page_size: int,
             total_pages: int, block_q: int, kv_block: int, kernel: str) -> pl.CostEstimate:
    """The bound of `attention_cost` (`_kv_reads`) over the latent pool; 2 * (R + Dr) + 2 * R
    flops per (query head, key)."""
    width = kv_lora_rank + rope_dim
    reads, attended = _kv_reads(num_tokens=num_tokens, max_seqs=max_seqs,
                                pages_per_seq=pages_per_seq, page_size=page_size,
                                total_pages=total_pages, block_q=block_q, kv_block=kv_block)
    q_out = num_tokens * num_heads * (width + kv_lora_rank) * dtype_bytes
    return _record(pl.CostEstimate(
        flops=2 * num_heads * (width + kv_lora_rank) * attended,
        transcendentals=num_heads * attended,
        bytes_accessed=reads * width * dtype_bytes + q_out), kernel)


def latent_write_cost(*, num_tokens: int, width: int, tile_rows: int, dtype_bytes: int,
                      kernel: str) -> pl.CostEstimate:
    """Latent write: each token's row read, written (and on TPU its tile of `tile_rows` rows
    read and written whole), plus its int32 slot."""
    row = width * dtype_bytes
    return _record(pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=num_tokens * (
        2 * row + 2 * tile_rows * row + 4)), kernel)
