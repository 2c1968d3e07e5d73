"""Scatter indices the engine sends never repeat (the order of duplicate updates is
unspecified on TPU/GPU): the page-table log deduplicated, and the test-mode check."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.engine import scatter_check
from seer_jax.engine.batch import RequestRows
from seer_jax.engine.model_runner import _set_entries
from seer_jax.engine.scatter_check import ScatterIndexError, check_unique, duplicates
from seer_jax.model.sampling_params import SamplingParams


def _req(pages):
    return types.SimpleNamespace(row=-1, sampling=SamplingParams(seed=0), prompt=[1, 2, 3],
                                 pages=list(pages))


def test_the_suite_runs_with_the_check_on():
    assert scatter_check.ENABLED, "tests/conftest.py sets SEER_CHECK_SCATTERS=1 before import"


def test_row_released_and_taken_again_before_a_sync_sends_each_entry_once():
    rows = RequestRows(2, 4)
    rows.tracking = True
    a = _req([3, 4])
    rows.acquire(a)
    rows.take_updates()  # synced
    rows.release(a, 2)  # logs entries 0, 1 = 0
    b = _req([5, 6])
    rows.acquire(b)  # the same row: logs entries 0, 1 = 5, 6
    whole, idx, val = rows.take_updates()
    assert not whole
    assert idx.tolist() == [0, 1] and val.tolist() == [5, 6]
    assert not len(duplicates(idx))


def test_updates_applied_as_one_scatter_reproduce_the_host_table():
    rng = np.random.default_rng(0)
    rows = RequestRows(8, 6)
    device = jnp.asarray(rows.pages)
    rows.tracking = True
    live = {}
    for _ in range(200):
        r = rng.integers(8)
        if r in live and rng.random() < 0.5:
            rows.release(live.pop(r), 6)
        elif r not in live:
            req = _req(rng.integers(1, 100, rng.integers(1, 7)))
            rows.acquire(req)
            live[req.row] = req
        if rng.random() < 0.3:
            whole, idx, val = rows.take_updates()
            if whole:  # more changed than the table holds: it is sent whole
                device = jnp.asarray(rows.pages)
                continue
            assert not len(duplicates(idx))
            device = _set_entries(device, jnp.asarray(idx), jnp.asarray(val))
            np.testing.assert_array_equal(device, rows.pages)


def test_the_check_names_the_scatter_and_the_repeated_indices(monkeypatch):
    monkeypatch.setattr(scatter_check, "ENABLED", True)
    check_unique("slots", [3, -1, -1, 7, 9])  # padding (-1) may repeat
    check_unique("table", [0, 1, 16, 16], hi=16)  # past the end: dropped padding
    with pytest.raises(ScatterIndexError, match=r"'page table entries' repeats target indices \[0, 1\]"):
        check_unique("page table entries", [0, 1, 0, 1])
    monkeypatch.setattr(scatter_check, "ENABLED", False)
    check_unique("off", [0, 0])
