"""Trace-time validation of kernel inputs (shapes, dtypes, static values) -> InputError."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from seer_jax.errors import InputError

IMPLS = ("auto", "reference", "tpu", "gpu")


def _shape(name: str, x: Any, rank: int) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != rank:
        raise InputError(f"{name} must have rank {rank}, got shape {shape}")
    return tuple(shape)


def concrete_or_none(x: Any) -> np.ndarray | None:
    """The value of x when it is known at trace time, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001 - abstract values of any kind
        return None


def check_attention_inputs(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents
) -> None:
    """Raise InputError for inconsistent shapes; check lengths too when they are concrete."""
    num_tokens, num_q_heads, head_dim = _shape("q [num_tokens, num_q_heads, head_dim]", q, 3)
    kvshape = _shape("kv_pages [total_pages, page_size, 2 * num_kv_heads, head_dim]", kv_pages,
                     4)
    _, page_size, combined, kv_head_dim = kvshape
    if combined < 2 or combined % 2:
        raise InputError(f"kv_pages {kvshape}: dimension 2 holds K and V of each KV head "
                         f"(2 * num_kv_heads), got {combined}")
    num_kv_heads = combined // 2
    if kv_head_dim != head_dim:
        raise InputError(f"q head_dim {head_dim} != kv_pages head_dim {kv_head_dim}")
    if num_q_heads % num_kv_heads:
        raise InputError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    max_seqs, pages_per_seq = _shape("page_indices [max_seqs, pages_per_seq]", page_indices, 2)
    (n_kv,) = _shape("kv_lens [max_seqs]", kv_lens, 1)
    (n_cu,) = _shape("cu_q_lens [max_seqs + 1]", cu_q_lens, 1)
    if n_kv != max_seqs or n_cu != max_seqs + 1:
        raise InputError(
            f"kv_lens {n_kv} / cu_q_lens {n_cu} must be max_seqs ({max_seqs}) / max_seqs + 1"
        )
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens)):
        if not np.issubdtype(np.dtype(x.dtype), np.integer):
            raise InputError(f"{name} must be an integer array, got {x.dtype}")
    if getattr(num_seqs, "shape", ()) not in ((), (1,)):
        raise InputError(f"num_seqs must be a scalar, got shape {num_seqs.shape}")
    if tree_parents is not None:
        (n_tree,) = _shape("tree_parents [num_tokens]", tree_parents, 1)
        if n_tree != num_tokens:
            raise InputError(f"tree_parents has {n_tree} entries, q has {num_tokens} tokens")
    if q.dtype != kv_pages.dtype:
        raise InputError(f"dtypes differ: q {q.dtype}, kv_pages {kv_pages.dtype}")
    # Value checks whenever the lengths are concrete (eager calls, tests, host-side batches).
    kv = concrete_or_none(kv_lens)
    cu = concrete_or_none(cu_q_lens)
    ns = concrete_or_none(num_seqs)
    if kv is None or cu is None or ns is None:
        return
    n = int(np.reshape(ns, ()))
    if not 0 <= n <= max_seqs:
        raise InputError(f"num_seqs={n} outside [0, max_seqs={max_seqs}]")
    q_lens = np.diff(cu[: n + 1])
    if np.any(q_lens < 0) or cu[0] != 0 or cu[n] > num_tokens:
        raise InputError(
            f"cu_q_lens must start at 0, be non-decreasing and end <= num_tokens ({num_tokens}): "
            f"{cu[: n + 1].tolist()}"
        )
    bad = np.nonzero(kv[:n] < q_lens)[0]
    if bad.size:
        s = int(bad[0])
        raise InputError(f"sequence {s}: kv_len {kv[s]} < q_len {q_lens[s]} (kv_len includes q)")
    need = -(-kv[:n] // page_size)
    bad = np.nonzero(need > pages_per_seq)[0]
    if bad.size:
        s = int(bad[0])
        raise InputError(
            f"sequence {s}: kv_len {kv[s]} needs {need[s]} pages of {page_size} but the page table "
            f"has {pages_per_seq} per sequence"
        )


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise InputError(f"impl={impl!r}; allowed: {', '.join(IMPLS)}")


def resolve_impl(impl: str) -> str:
    """'auto' -> the kernel for the default backend ('tpu', 'gpu'), else 'reference'."""
    check_impl(impl)
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "reference"
