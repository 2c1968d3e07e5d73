"""Uniqueness of the indices of every scatter the engine sends to the device.

XLA leaves the order of duplicate scatter updates unspecified: XLA:CPU applies them in order,
TPUs and GPUs may not, so a scatter with a repeated index can let a stale value win on the
accelerator while every CPU test passes. The engine builds its scatter indices so that they
cannot repeat (page-table updates are deduplicated keeping the last value; KV slots, page copies
and page imports name distinct targets by construction). This module checks that claim.

The check is a test mode: on when the environment variable `SEER_CHECK_SCATTERS` is `1` when
this module is first imported (the test suite sets it), off otherwise, so production steps pay
nothing. A violation raises `ScatterIndexError`, naming the scatter and the repeated indices.
"""

from __future__ import annotations

import os

import numpy as np

from seer_jax.errors import SeerError

ENV = "SEER_CHECK_SCATTERS"
ENABLED = os.environ.get(ENV, "") == "1"


class ScatterIndexError(SeerError):
    """A scatter the engine was about to send repeats a target index."""


def duplicates(idx, *, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The indices that occur more than once among those in [lo, hi) (others are padding the
    scatter drops)."""
    a = np.asarray(idx).reshape(-1)
    keep = a >= lo
    if hi is not None:
        keep &= a < hi
    vals, counts = np.unique(a[keep], return_counts=True)
    return vals[counts > 1]


def check_unique(name: str, idx, *, lo: int = 0, hi: int | None = None) -> None:
    """Raise `ScatterIndexError` when `idx` (the targets of scatter `name`) repeats an index in
    [lo, hi); a no-op unless the check is enabled."""
    if not ENABLED:
        return
    dup = duplicates(idx, lo=lo, hi=hi)
    if len(dup):
        raise ScatterIndexError(
            f"scatter {name!r} repeats target indices {dup[:8].tolist()} "
            f"({len(dup)} repeated); the order of duplicate updates is unspecified on TPU/GPU")
