"""Adaptive speculation budget: γ*, on/off, tree width, marginal-benefit allocation, online β."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer_jax.drafting import Draft
from seer_jax.drafting.budget import (
    AcceptanceStats,
    BudgetConfig,
    BudgetPlan,
    SpeculationBudget,
)
from seer_jax.errors import ConfigError


def roofline(b: int, g: int) -> float:
    """Overhead + max(memory-bound floor, compute ∝ tokens) + a small per-token cost."""
    n = b * (1 + g)
    return 1e-3 + max(4e-3, 4e-3 * n / 256) + 2e-6 * n


def budget(beta=0.6, **kw) -> SpeculationBudget:
    return SpeculationBudget(roofline, BudgetConfig(beta_init=beta, **kw))


# -- planning --------------------------------------------------------------------------------------


def test_speculation_off_at_large_batch():
    b = budget()
    for B in (512, 1024, 4096):
        plan = b.plan(B)
        assert plan.gamma_star == 0 and not plan.enabled and plan.total_tokens == 0
        drafts = [Draft.chain([1, 2, 3], [0.9, 0.8, 0.7])] * B
        assert all(len(d) == 0 for d in b.allocate(drafts, plan=plan))
    assert b.plan(8).enabled


def test_gamma_grows_as_batch_shrinks():
    b = budget()
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    gammas = [b.optimal_gamma(B) for B in sizes]
    assert gammas == sorted(gammas, reverse=True)
    assert gammas[0] == b.config.gamma_max and gammas[-1] == 0
    assert len(set(gammas)) >= 4  # it really adapts, not just on/off
    # γ* really is the argmin of T_SD
    for B, g in zip(sizes, gammas, strict=True):
        assert all(b.t_sd(B, g) <= b.t_sd(B, h) + 1e-15 for h in range(9))


def test_lower_acceptance_means_shorter_drafts():
    lo, hi = budget(beta=0.2), budget(beta=0.8)
    for B in (16, 32, 64, 128):
        assert lo.optimal_gamma(B) <= hi.optimal_gamma(B)
    assert lo.optimal_gamma(32) < hi.optimal_gamma(32)


def test_wider_trees_only_when_batch_is_small():
    b = budget()
    assert b.plan(1).width == b.config.max_width
    assert b.plan(64).width == 1
    widths = [b.plan(B).width for B in (1, 2, 4, 8, 16, 32, 64)]
    assert widths == sorted(widths, reverse=True)
    p = b.plan(2)
    assert p.total_tokens == p.gamma_star * 2 * p.width
    assert p.max_nodes_per_request == b.config.gamma_max * p.width and p.max_depth == 8


def test_default_cost_model_and_profile_json(tmp_path):
    from seer_jax.costs import (
        RooflineCostModel,
        get_accelerator,
        get_model,
        profile_from_cost_model,
    )

    cfg = BudgetConfig(beta_init=0.6)
    default = SpeculationBudget.from_profile_json(None, cfg)
    assert default.plan(1).gamma_star == 8
    cost = RooflineCostModel(get_model(cfg.default_model), get_accelerator(cfg.default_accelerator))
    prof = profile_from_cost_model(cost, gammas=(0, 1, 2, 4, 8, 16, 32),
                                   context_tokens=(cfg.context_tokens,))
    prof.save(tmp_path / "profile.json")
    measured = SpeculationBudget.from_profile_json(tmp_path / "profile.json", cfg)
    for B in (1, 4, 16, 64, 256):
        # the profile is a piecewise-linear fit of sampled points: γ* agrees within one step
        assert abs(measured.plan(B).gamma_star - default.plan(B).gamma_star) <= 1
        assert measured.plan(B).enabled == default.plan(B).enabled
    with pytest.raises(ConfigError, match="not found"):
        SpeculationBudget.from_profile_json(tmp_path / "missing.json", cfg)


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="gamma_max"):
        BudgetConfig(gamma_max=0).validate()
    with pytest.raises(ConfigError, match="ema_decay"):
        SpeculationBudget(roofline, BudgetConfig(ema_decay=0.0))


# -- allocation ------------------------------------------------------------------------------------


def _plan(total, B, per_req=8, depth=8, width=1):
    return BudgetPlan(B, max(total // max(B, 1), 1), total, width, per_req, depth)


def test_allocation_goes_to_the_most_likely_tokens_first():
    b = budget(beta=1.0)  # β = 1: benefit = draft path probability
    sure = Draft.chain([1, 2, 3, 4], [0.95, 0.9, 0.85, 0.8])
    shaky = Draft.chain([5, 6, 7, 8], [0.5, 0.2, 0.1, 0.05])
    out = b.allocate([sure, shaky], plan=_plan(5, 2))
    assert [len(d) for d in out] == [4, 1]
    out = b.allocate([sure, shaky], plan=_plan(2, 2))
    assert [len(d) for d in out] == [2, 0]


def test_high_priority_class_gets_lambda_weight():
    b = budget(beta=0.7)
    d = Draft.chain([1, 2, 3, 4, 5, 6], [0.9] * 6)
    out = b.allocate([d, d], priorities=[0, 1], plan=_plan(6, 2))
    assert len(out[1]) > len(out[0])
    # λ = 2 equals halving the other draft's probabilities
    half = Draft.chain([1, 2, 3, 4, 5, 6], [0.45] * 6)
    same = b.allocate([half, d], priorities=[0, 0], plan=_plan(6, 2))
    assert [len(x) for x in same] == [len(x) for x in out]


def test_per_request_cap_and_depth_cap():
    b = budget(beta=1.0)
    d = Draft.chain(list(range(8)), [0.9] * 8)
    out = b.allocate([d, d], plan=_plan(16, 2, per_req=3))
    assert [len(x) for x in out] == [3, 3]
    tree = Draft(np.array([1, 2, 3, 4], np.int32), np.array([-1, 0, 1, -1], np.int32),
                 np.array([0.9, 0.9, 0.9, 0.5], np.float32))
    (cut,) = b.allocate([tree], plan=_plan(8, 1, depth=2, width=2))
    assert cut.tokens.tolist() == [1, 2, 4] and cut.parents.tolist() == [-1, 0, -1]


@st.composite
def random_drafts(draw):
    drafts = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 7))
        parents, probs = [], []
        for i in range(n):
            p = draw(st.integers(-1, i - 1))
            parents.append(p)
            base = 1.0 if p < 0 else probs[p]
            probs.append(base * draw(st.sampled_from([1.0, 0.9, 0.6, 0.5, 0.3])))
        drafts.append(Draft(np.arange(n, dtype=np.int32), np.array(parents, np.int32),
                            np.array(probs, np.float32)))
    prios = draw(st.lists(st.integers(0, 1), min_size=len(drafts), max_size=len(drafts)))
    total = draw(st.integers(len(drafts), 30))  # Γ ≥ B: speculation on
    per_req = draw(st.integers(1, 8))
    return drafts, prios, total, per_req


@settings(max_examples=150, deadline=None)
@given(random_drafts(), st.floats(0.2, 1.0))
def test_allocation_equals_greedy_marginal_benefit(case, beta):
    """Against an independent greedy: repeatedly take the frontier node (parent taken) with the
    largest marginal benefit, respecting per-request caps and the total."""
    drafts, prios, total, per_req = case
    b = budget(beta=beta)
    b.stats.beta = np.linspace(beta, beta / 2, 8)
    plan = _plan(total, len(drafts), per_req=per_req, depth=8, width=2)
    got = b.allocate(drafts, prios, plan=plan)
    reach = np.cumprod(b.stats.beta)

    def benefit(r, i):
        d = drafts[r]
        return (2.0 if prios[r] else 1.0) * reach[d.depths()[i] - 1] * float(d.probs[i])

    frontier = [(-benefit(r, i), r, i) for r, d in enumerate(drafts) for i in range(len(d))
                if d.parents[i] < 0]
    heapq.heapify(frontier)
    taken = [0] * len(drafts)
    want_total = 0.0
    budget_left = total
    while frontier and budget_left:
        nb, r, i = heapq.heappop(frontier)
        if taken[r] >= per_req:
            continue
        taken[r] += 1
        budget_left -= 1
        want_total += -nb
        for j in range(len(drafts[r])):
            if drafts[r].parents[j] == i:
                heapq.heappush(frontier, (-benefit(r, j), r, j))
    got_total = 0.0
    for r, d in enumerate(got):
        d.validate()
        assert len(d) <= per_req
        # a sub-tree of the candidate: every kept node's path exists in the candidate
        cand_paths = {tuple(drafts[r].path_to(i)) for i in range(len(drafts[r]))}
        for i in range(len(d)):
            assert tuple(d.path_to(i)) in cand_paths
            got_total += (2.0 if prios[r] else 1.0) * reach[d.depths()[i] - 1] * float(d.probs[i])
    assert sum(len(d) for d in got) == sum(taken)
    assert got_total == pytest.approx(want_total, rel=1e-9, abs=1e-12)


# -- online acceptance rates -----------------------------------------------------------------------


def test_ema_tracks_conditional_acceptance_per_position():
    stats = AcceptanceStats(gamma_max=4, decay=0.02, init=0.5)
    rng = np.random.default_rng(0)
    true = np.array([0.8, 0.5, 0.25, 0.9])
    for _ in range(4000):
        acc = 0
        while acc < 4 and rng.random() < true[acc]:
            acc += 1
        stats.observe(4, acc)
    np.testing.assert_allclose(stats.beta, true, atol=0.12)
    assert stats.expected_accepted(2) == pytest.approx(stats.beta[0] + stats.beta[0] * stats.beta[1])


def test_observe_only_counts_tried_positions():
    stats = AcceptanceStats(gamma_max=4, decay=0.5, init=0.5)
    stats.observe(2, 2)  # both accepted; positions 3, 4 were never offered
    np.testing.assert_allclose(stats.beta, [0.75, 0.75, 0.5, 0.5])
    stats.observe(4, 0)  # first rejected; later ones not tried
    np.testing.assert_allclose(stats.beta, [0.375, 0.75, 0.5, 0.5])
    np.testing.assert_array_equal(stats.observations, [2, 1, 0, 0])


def test_measured_acceptance_turns_speculation_off_and_relaxes_back():
    b = budget(beta=0.9)
    assert b.plan(128, relax=False).enabled and b.plan(1, relax=False).gamma_star == 8
    for _ in range(200):
        b.stats.observe(8, 0)  # drafts keep failing
    assert not b.plan(128, relax=False).enabled
    assert not b.plan(1, relax=False).enabled  # nothing is accepted: never worth it
    steps = 0
    while not b.plan(64).enabled:  # off: β drifts back toward the prior, speculation is retried
        steps += 1
        assert steps < 5000
    assert steps > 5


def test_a_budget_without_a_profile_is_timed_by_the_model_its_engine_serves():
    from seer_jax.costs import get_model
    from seer_jax.drafting.budget import SpeculationBudget, default_step_time
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params

    default = SpeculationBudget()
    qwen = default.step_time(64, 4)
    default.serve(get_model("smollm2"))
    assert default.step_time(64, 4) < qwen  # a 135M model's roofline, not the 7B default
    profiled = SpeculationBudget(step_time=lambda b, g: 1.0)
    profiled.serve(get_model("smollm2"))
    assert profiled.step_time(64, 4) == 1.0  # a measured profile wins
    cfg = tiny_config()
    eng = Engine(cfg, init_params(cfg, 0), EngineConfig(num_pages=16, page_size=8, speculation=True))
    want = default_step_time(eng.spec.budget.config, cfg.cost_spec())
    assert eng.spec.budget.step_time(8, 2) == pytest.approx(want(8, 2))


# -- the expected-value allocation (the simulator's model of drafting) ----------------------------


def test_set_reach_gives_the_reach_back():
    s = AcceptanceStats(4)
    s.set_reach([0.8, 0.4, 0.2, 0.0])
    assert s.beta.tolist() == pytest.approx([0.8, 0.5, 0.5, 0.0])
    assert s.reach().tolist() == pytest.approx([0.8, 0.4, 0.2, 0.0])
    s.set_reach([0.0, 0.0, 0.0, 0.0])  # nothing reached: later positions are 0, not NaN
    assert s.beta.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_allocate_expected_matches_greedy_marginal_benefit():
    rng = np.random.default_rng(0)
    b = budget(gamma_max=6, max_width=1)
    for _ in range(20):
        n = int(rng.integers(1, 12))
        beta = rng.uniform(0.1, 0.95, size=(n, 6))
        reach = np.cumprod(beta, axis=1)
        prio = rng.integers(0, 2, size=n).tolist()
        total = int(rng.integers(n, 6 * n + 1))
        plan = BudgetPlan(n, max(1, total // n), total, 1, 6, 6)
        got = b.allocate_expected(reach, prio, plan)
        w = np.where(np.asarray(prio) > 0, b.config.priority_weight, 1.0)
        vals = sorted(((w[r] * reach[r, j], r, j) for r in range(n) for j in range(6)),
                      key=lambda x: -x[0])[:total]
        want = np.zeros(n, np.int64)
        for _, r, _ in vals:
            want[r] += 1
        assert got.tolist() == want.tolist()
        assert got.sum() == min(total, 6 * n)


def test_allocate_expected_off_and_depth_cap():
    b = budget(gamma_max=4, max_width=1)
    reach = np.cumprod(np.full((3, 4), 0.9), axis=1)
    assert b.allocate_expected(reach, None, BudgetPlan(3, 0, 0, 1, 0, 0)).tolist() == [0, 0, 0]
    assert b.allocate_expected(reach, None, BudgetPlan(3, 2, 6, 1, 2, 2)).tolist() == [2, 2, 2]


# -- a budget fitted to measured steps -------------------------------------------------------------


def _fed(step_cost, steps=40):
    """A default budget (no profile) whose engine's steps are the clock, fed `steps` steps of
    1..16 sequences with 1 + 0..3 tokens each, costing step_cost(tokens) seconds."""
    from seer_jax.costs import get_model

    b = SpeculationBudget(config=BudgetConfig(beta_init=0.5))
    b.serve(get_model("smollm2-135m"))
    b.measure_steps()
    rng = np.random.RandomState(0)
    for _ in range(steps):
        n = int(rng.randint(1, 17)) * int(rng.randint(1, 5))
        b.observe_step(n, step_cost(n))
    return b


def test_measured_compute_bound_steps_turn_speculation_off_where_the_roofline_keeps_it():
    """Steps whose cost grows with every token (a CPU): a draft token of acceptance 0.5 is not
    worth verifying at 8 sequences, though an accelerator roofline finds it nearly free."""
    roof = SpeculationBudget(config=BudgetConfig(beta_init=0.5))
    from seer_jax.costs import get_model

    roof.serve(get_model("smollm2-135m"))
    assert roof.plan(8, relax=False).enabled
    b = _fed(lambda n: 0.01 + 0.02 * n)
    assert b.step_time.a == pytest.approx(0.01) and b.step_time.b == pytest.approx(0.02)
    assert not b.plan(8, relax=False).enabled
    # overhead-bound steps (a tiny model): drafts are nearly free, speculation stays on
    b = _fed(lambda n: 0.05 + 1e-5 * n)
    assert b.plan(8, relax=False).enabled and b.plan(8, relax=False).gamma_star > 1


def test_fitted_step_time_falls_back_to_the_roofline_until_enough_steps():
    b = _fed(lambda n: 0.01 + 0.02 * n, steps=3)
    assert b.step_time.a is None
    assert b.step_time(8, 2) == b.step_time.fallback(8, 2)
    given = SpeculationBudget(lambda B, g: 1.0)  # an explicit step time is never replaced
    given.measure_steps()
    given.observe_step(100, 5.0)
    assert given.step_time(8, 2) == 1.0
