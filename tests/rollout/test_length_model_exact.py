"""The length model's fast paths give bit-identical results: log_ndtr evaluated in place, the
censored terms of a fit computed once per distinct (group grid, point), and the quantile grid's
survival cached per params (simulated makespans must not move with them)."""

from __future__ import annotations

import math

import numpy as np

from seer_jax.rollout.core.policies.length_model import GroupLengthModel, _Data, log_ndtr
from tests.rollout.test_seer_posterior import finish, make_groups, progress


def _log_ndtr_nested(x):
    """The textbook nested form of the same Chebyshev erfc approximation."""
    x = np.asarray(x, dtype=np.float64)
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    log_erfc = np.log(t) - z * z + poly
    return np.where(x < 0.0, log_erfc - math.log(2.0), np.log1p(-0.5 * np.exp(log_erfc)))


def test_log_ndtr_is_bit_identical_to_the_nested_form():
    rng = np.random.default_rng(0)
    for x in [rng.normal(0, 3, (64, 41)), rng.normal(0, 40, 257), -np.abs(rng.normal(0, 2, 9)),
              np.abs(rng.normal(0, 2, (3, 4))), np.array(0.7), np.array(-1.5),
              np.array([0.0, -0.0, 1e-300, -1e-300, 38.0, -38.0])]:
        got, want = log_ndtr(x), _log_ndtr_nested(x)
        assert got.shape == want.shape and np.array_equal(got, want)


def _groups_with_shared_censoring_points():
    groups = make_groups(24, 8)
    rng = np.random.default_rng(1)
    for gi, g in enumerate(groups):
        for j, r in enumerate(g.requests):
            if gi % 3 == 0 and j < 3:
                finish(r, int(rng.integers(20, 900)))
            else:
                progress(r, (1 + j % 3) * 256)  # siblings stand at chunk boundaries
    return groups


def test_fit_with_deduplicated_censoring_equals_the_plain_fit(monkeypatch):
    groups = _groups_with_shared_censoring_points()
    d = GroupLengthModel(4096)._data(groups)
    d.dedupe_censored()
    assert d.c_first is not None and len(d.c_first) < len(d.c) / 4
    fast = GroupLengthModel(4096)
    p_fast = fast.fit(groups)
    monkeypatch.setattr(_Data, "dedupe_censored", lambda self: None)
    plain = GroupLengthModel(4096)
    p_plain = plain.fit(groups)
    assert p_fast == p_plain
    # the quantile grid's cache gives what a fresh computation gives
    for g in groups[:6]:
        reqs = [r for r in g.requests if r.status != "done"]
        if reqs:
            a = fast.remaining_quantile(g, reqs, 0.9)
            b = fast.remaining_quantile(g, reqs, 0.9)
            fast._sx_cache.clear()
            assert np.array_equal(a, b)
            assert np.array_equal(a, fast.remaining_quantile(g, reqs, 0.9))
            assert np.array_equal(a, plain.remaining_quantile(g, reqs, 0.9))


def test_cached_posterior_equals_the_plain_one():
    groups = _groups_with_shared_censoring_points()
    model = GroupLengthModel(4096)
    model.fit(groups)
    for g in groups[:8]:
        a, w = model.posterior(g)
        a2, w2 = model.posterior(g)  # served from the row cache
        d = model._data([g])
        grid, _ = model._grid(model.params, d)
        ll = model._group_log_joint(model.params, grid, d)[0]
        want = np.exp(ll - ll.max())
        assert np.array_equal(a, grid[0]) and np.array_equal(a2, a)
        assert np.array_equal(w, want / want.sum()) and np.array_equal(w2, w)
