"""Seer's posterior length estimator: the censored log-normal fit, per-request quantiles, and the
ordering the `seer` policy derives from them (policies/length_model.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special

from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies import GroupState, RequestState, make_policy
from seer_jax.rollout.core.policies.length_model import (
    WIDE,
    GroupLengthModel,
    LengthParams,
    log_ndtr,
    nelder_mead,
)
from tests.rollout.test_policies import make_groups as policy_groups

MAX = 4096


def make_groups(n_groups: int, group_size: int, max_tokens: int = MAX) -> list[GroupState]:
    return policy_groups(n_groups, group_size, max_tokens)


def finish(req: RequestState, n: int) -> None:
    req.output_ids = [7] * n
    req.status = "done"
    req.finish_reason = "length" if n >= req.max_tokens else "eos"
    req.group.record_finished(req)


def progress(req: RequestState, n: int) -> None:
    req.output_ids = [7] * n
    req.group.record_progress(req)


def snapshot_workload(params: LengthParams, n_groups: int, group_size: int, horizon: float,
                      seed: int, max_tokens: int = 1 << 20):
    """Groups as a rollout sees them part-way: each response has had `budget` tokens of service
    (log-uniform up to `horizon`); it is finished if its true length fits, else censored."""
    rng = np.random.default_rng(seed)
    groups = make_groups(n_groups, group_size, max_tokens)
    a = rng.normal(0, params.tau, n_groups)
    for g, ag in zip(groups, a, strict=True):
        for r in g.requests:
            L = int(np.clip(np.exp(params.mu + ag + rng.normal(0, params.sigma)), 1, max_tokens))
            budget = int(np.exp(rng.uniform(0, math.log(horizon))))
            if L <= budget:
                finish(r, L)
            else:
                progress(r, budget)
    return groups


def test_log_ndtr_matches_scipy_in_both_tails():
    x = np.linspace(-35, 8, 4001)
    ours, ref = log_ndtr(x), special.log_ndtr(x)
    # relative error of Phi below 2e-7 (in log space: absolute)
    assert np.max(np.abs(ours - ref)) < 2e-7
    assert np.all(np.isfinite(ours))


def test_nelder_mead_minimises_a_quadratic():
    x, f = nelder_mead(lambda v: float((v[0] - 1.5) ** 2 + 3 * (v[1] + 0.5) ** 2 + 2), np.zeros(2),
                       max_evals=500, tol=1e-12)
    assert abs(x[0] - 1.5) < 1e-3 and abs(x[1] + 0.5) < 1e-3 and abs(f - 2) < 1e-6


def test_fit_recovers_parameters_from_censored_snapshot():
    true = LengthParams(mu=6.0, tau=0.9, sigma=0.5)
    groups = snapshot_workload(true, 300, 8, horizon=2000.0, seed=1)
    done = [r for g in groups for r in g.requests if r.status == "done"]
    assert 0.1 < len(done) / 2400 < 0.8  # really censored: many responses still running
    model = GroupLengthModel(1 << 20)
    fit = model.fit(groups)
    assert abs(fit.mu - true.mu) < 0.12
    assert abs(fit.tau - true.tau) / true.tau < 0.15
    assert abs(fit.sigma - true.sigma) / true.sigma < 0.15
    # what the censoring corrects: the finished responses alone look much shorter
    naive = np.mean([math.log(r.generated) for r in done])
    assert naive < true.mu - 0.5


# The fitted ICC is unbiased but noisy at 200 groups of 8: over 12 seeds its error is -0.012
# +- 0.044 at tau 0.375, sigma 0.5 (-0.003 +- 0.033 at 0.3/0.9, -0.004 +- 0.011 at 1.0/0.3).
# The 0.12 tolerance is ~2.7 sd there, so fixed (derandomized) examples keep the test stable.
@settings(max_examples=10, deadline=None, derandomize=True)
@given(st.floats(0.3, 1.2), st.floats(0.2, 0.9), st.integers(0, 10_000))
def test_fit_recovers_icc(tau, sigma, seed):
    true = LengthParams(mu=5.0, tau=tau, sigma=sigma)
    groups = snapshot_workload(true, 200, 8, horizon=1500.0, seed=seed)
    fit = GroupLengthModel(1 << 20).fit(groups)
    assert abs(fit.icc - true.icc) < 0.12
    assert abs(fit.mu - true.mu) < 0.25


def test_remaining_quantile_matches_monte_carlo():
    model = GroupLengthModel(1 << 16)
    model.params = LengthParams(mu=6.0, tau=0.8, sigma=0.6, eps=0.03)
    g = make_groups(1, 4, 1 << 16)[0]
    finish(g.requests[0], 300)
    finish(g.requests[1], 500)
    progress(g.requests[2], 700)
    pts, w = model.posterior(g)
    for q in (0.5, 0.9, 0.99):
        got = model.remaining_quantile(g, [g.requests[2], g.requests[3]], q, posterior=(pts, w))
        # sample a ~ posterior (grid), L ~ LogNormal(mu + a, sigma) given L > n
        rng = np.random.default_rng(0)
        a = pts[rng.choice(len(w), size=400_000, p=w)]
        pr = model.params
        wide = rng.random(a.size) < pr.eps  # the runaway component
        e = rng.normal(0, pr.sigma, a.size) * np.where(wide, WIDE, 1.0)
        L = np.exp(pr.mu + a + e)
        # request 2 is censored at 700 (its factor is in the posterior): reweight by 1/P(L>n|a)
        for n, val in ((700, got[0]), (0, got[1])):
            keep = L > n + 0.5
            if n > 0:
                z = (math.log(n + 0.5) - pr.mu - a) / pr.sigma
                sf = (1 - pr.eps) * special.ndtr(-z) + pr.eps * special.ndtr(-z / WIDE)
                wts = (1.0 / sf)[keep]
            else:
                wts = np.ones(int(keep.sum()))
            srt = np.argsort(L[keep])
            cdf = np.cumsum(wts[srt]) / wts.sum()
            mc = L[keep][srt][np.searchsorted(cdf, q)] - n
            assert abs(val - mc) / mc < 0.05, (q, n, val, mc)


def test_remaining_quantile_is_monotone_and_capped():
    model = GroupLengthModel(MAX)
    model.params = LengthParams(mu=5.0, tau=0.8, sigma=0.5)
    short, long_ = make_groups(2, 3)
    finish(short.requests[0], 40)
    finish(long_.requests[0], 900)
    qs, ql = (model.remaining_quantile(g, g.requests[1:2], 0.9)[0] for g in (short, long_))
    assert qs < ql
    lo, hi = (model.remaining_quantile(short, short.requests[1:2], q)[0] for q in (0.5, 0.99))
    assert lo < hi
    progress(long_.requests[1], MAX - 10)
    assert model.remaining_quantile(long_, [long_.requests[1]], 0.99)[0] <= 10
    with pytest.raises(ConfigError, match="quantile"):
        model.remaining_quantile(short, short.requests, 1.0)


def bound_posterior(groups, **options):
    p = make_policy("seer")
    opts = {"starvation_pops": 0, "estimator": "posterior"}
    opts.update(options)
    p.bind(groups, opts)
    for g in groups:
        for r in g.requests:
            p.push(r)
    return p


def finish_popped(p, req, n):
    """What the controller does when `req` (popped) ends its last chunk with n tokens."""
    req.output_ids = [7] * n
    req.status = "done"
    req.finish_reason = "eos"
    req.group.record_finished(req)
    p.on_request_finished(req)


def test_posterior_probes_first_shortest_generated_first():
    groups = make_groups(3, 2)
    p = bound_posterior(groups)
    probes = [p.pop() for _ in range(3)]
    assert [r.request_id for r in probes] == ["g0/0", "g1/0", "g2/0"]
    for r, n in zip(probes, (300, 100, 200), strict=True):
        r.output_ids = [7] * n
        r.group.record_progress(r)
        p.on_chunk_end(r)
        p.push(r)
    assert [p.pop().request_id for _ in range(3)] == ["g1/0", "g2/0", "g0/0"]


def _short_and_long_groups(seed: int):
    """24 groups of 4 under seer's posterior: three siblings of each of the first 12 finished
    short (~50 tokens), of the rest long (~1500); the fourth siblings have not run."""
    groups = make_groups(24, 4)
    p = make_policy("seer")
    p.bind(groups, {"starvation_pops": 0, "estimator": "posterior"})
    rng = np.random.default_rng(seed)
    for gi, g in enumerate(groups):
        base = 50 if gi < 12 else 1500
        for r in g.requests[:3]:  # ran and finished (never buffered here)
            finish_popped(p, r, int(base * math.exp(rng.normal(0, 0.2))))
    return groups, p


def test_posterior_defers_confidently_short_groups_and_learns_from_siblings():
    # after the refit the model knows lengths are prompt-driven
    groups, p = _short_and_long_groups(0)
    assert p.model.fits >= 1 and p.length_params.icc > 0.8
    for g in groups:
        p.push(g.requests[3])
    order = []
    while (r := p.pop()) is not None:
        order.append(r.group.index)
    # every long group's last sibling before any short group's
    assert sorted(order[:12]) == list(range(12, 24)) and sorted(order[12:]) == list(range(12))
    # a short group's sibling that outlives its group rises above its short peers
    p.push(groups[1].requests[3])
    g0 = groups[0].requests[3]
    g0.output_ids = [7] * 400
    g0.group.record_progress(g0)
    p.on_chunk_end(g0)
    p.push(g0)
    assert p.pop() is g0 and p.pop() is groups[1].requests[3]


def test_posterior_ranks_a_lone_long_sibling_as_unknown_once_it_outlives_its_group():
    # the fourth sibling of short group 0 is still running
    groups, p = _short_and_long_groups(1)
    shortest = min(r.generated for r in groups[0].requests[:3])
    lone = groups[0].requests[3]

    def rank(generated: int) -> list[int]:
        lone.output_ids = [7] * generated
        lone.group.record_progress(lone)
        p.on_chunk_end(lone)
        for g in (groups[0], *groups[12:]):
            p.push(g.requests[3])
        out = []
        while (r := p.pop()) is not None:
            out.append(r.group.index)
        return out

    # within twice its group's shortest: the model's short estimate holds, it goes last
    assert rank(2 * shortest)[-1] == 0
    assert p.estimate_remaining(lone) < 1500
    # past it: ranked as if its group were unknown (max_tokens - generated), ahead of every
    # long group's fresh sibling
    assert rank(2 * shortest + 1)[0] == 0
    assert p.estimate_remaining(lone) >= MAX - (2 * shortest + 1)


def test_posterior_without_group_signal_falls_back_to_fcfs():
    groups = make_groups(3, 3)
    p = bound_posterior(groups)
    order = [p.pop().request_id for _ in range(3)]  # probes
    assert order == ["g0/0", "g1/0", "g2/0"]
    # no length seen: the rest in first-come order (ties on the quantile)
    assert [p.pop().request_id for _ in range(6)] == [
        "g0/1", "g0/2", "g1/1", "g1/2", "g2/1", "g2/2"]


def test_posterior_options_are_checked():
    groups = make_groups(1, 2)
    with pytest.raises(ConfigError, match="estimator"):
        make_policy("seer").bind(groups, {"estimator": "magic"})
    with pytest.raises(ConfigError, match="quantile"):
        make_policy("seer").bind(groups, {"quantile": 1.5})
    p = make_policy("seer")
    p.bind(groups, {"estimator": "posterior",
                    "length_prior": {"mu": 3.0, "tau": 0.5, "sigma": 0.4}})
    assert p.length_params == LengthParams(3.0, 0.5, 0.4)


def test_requeues_do_not_trigger_length_model_refits():
    # placement found no room, over and over: re-queues are not generated tokens, so they must
    # not count towards the refit schedule (the first fit waits for 4 tokens per request)
    groups = make_groups(2, 2)
    p = bound_posterior(groups)
    for _ in range(50):
        r = p.pop()
        p.push(r, requeue=True)
    r = p.pop()
    r.output_ids = [7] * 3
    r.group.record_progress(r)
    p.on_chunk_end(r)
    assert p.model.fits == 0 and not p.wants_progress()
    # generated tokens do: 16 = 4 per request
    p.push(r)
    r = p.pop()
    r.output_ids = [7] * 16
    r.group.record_progress(r)
    p.on_chunk_end(r)
    assert p.model.fits == 1
