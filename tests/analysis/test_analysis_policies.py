"""Unit tests of the analysis policies: oracles and diagnostic variants of seer."""

from __future__ import annotations

import math

import pytest

from seer_jax.analysis.policies import CATALOG, Hindsight
from seer_jax.analysis.policies.conditional_quantile import MIN_MATCHES
from seer_jax.analysis.policies.seer_prompt_oracle import lognormal_remaining_quantile as rq
from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies import RequestState
from tests.rollout.test_policies import MAX, bound, drain, make_groups, run_chunk


def test_oracle_lfs_orders_by_true_remaining_length():
    groups = make_groups(2, 2)
    lengths = {"g0/0": 50, "g0/1": 700, "g1/0": 5000, "g1/1": 300}
    p = bound("oracle_lfs", groups, Hindsight(true_lengths=lengths))
    first = p.pop()
    assert first.request_id == "g1/0"  # min(5000, max_tokens)=1000 remaining
    run_chunk(p, first, 900, finished=False)  # 100 left now
    assert drain(p) == ["g0/1", "g1/1", "g1/0", "g0/0"]


def test_oracle_lfs_needs_lengths():
    groups = make_groups(1, 2)
    with pytest.raises(ConfigError, match="'oracle_lfs' needs true lengths"):
        CATALOG.make("oracle_lfs").bind(groups, {})
    with pytest.raises(ConfigError, match="no length for 1"):
        CATALOG.make("oracle_lfs", Hindsight(true_lengths={"g0/0": 3})).bind(groups, {})


def test_oracle_group_lfs_knows_each_groups_longest_response_not_which_sibling():
    groups = make_groups(2, 3)
    lengths = {"g0/0": 50, "g0/1": 900, "g0/2": 40, "g1/0": 600, "g1/1": 500, "g1/2": 550}
    p = bound("oracle_group_lfs", groups, Hindsight(true_lengths=lengths))
    # g0's longest is 900 > g1's 600: all of g0 first, in arrival order (it cannot tell that
    # g0/1 is the long one), then g1
    first = p.pop()
    assert first.request_id == "g0/0"
    assert p.estimate_remaining(first) == 900
    run_chunk(p, first, 400, finished=False)  # 500 left of g0's 900: now below g1's 600
    assert drain(p) == ["g0/1", "g0/2", "g1/0", "g1/1", "g1/2", "g0/0"]
    with pytest.raises(ConfigError, match="needs true lengths"):
        CATALOG.make("oracle_group_lfs").bind(groups, {})


def test_seer_running_oracle_keys_started_requests_by_their_groups_true_longest():
    """Fresh requests are ranked as seer ranks them (posterior quantile); a request that has
    generated tokens is keyed by its group's true longest length minus what it generated."""
    lengths = {"g0/0": 100, "g0/1": 120, "g0/2": 900, "g1/0": 300, "g1/1": 350, "g1/2": 320}
    h = Hindsight(true_lengths=lengths)
    gp, gr = make_groups(2, 3), make_groups(2, 3)  # same state, one per policy
    p = bound("seer_running_oracle", gp, h, estimator="posterior", starvation_pops=0)
    ref = bound("seer", gr, estimator="posterior", starvation_pops=0)

    def fresh_keys_agree():
        return all(p.estimate_remaining(a) == ref.estimate_remaining(b)
                   for ga, gb in zip(gp, gr, strict=True)
                   for a, b in zip(ga.requests, gb.requests, strict=True) if a.generated == 0)

    assert fresh_keys_agree()
    for i, n in ((0, 60), (1, 10)):  # the probes of g0, g1 run a chunk each
        a, b = p.pop(), ref.pop()
        assert a.request_id == b.request_id == f"g{i}/0"  # probes first, as in seer
        run_chunk(p, a, n, finished=False)
        run_chunk(ref, b, n, finished=False)
    assert p.estimate_remaining(gp[0].requests[0]) == 900 - 60  # g0's longest: g0/2's 900
    assert p.estimate_remaining(gp[1].requests[0]) == 350 - 10
    assert ref.estimate_remaining(gr[0].requests[0]) != 900 - 60
    assert fresh_keys_agree()  # the siblings that have not started keep seer's estimate
    with pytest.raises(ConfigError, match="needs true lengths"):
        CATALOG.make("seer_running_oracle").bind(make_groups(1, 2), {})
    with pytest.raises(ConfigError, match="estimator='max_finished' is not supported"):
        CATALOG.make("seer_running_oracle", h).bind(make_groups(2, 3), {"estimator": "max_finished"})


def test_lognormal_remaining_quantile_matches_scipy():
    from scipy.stats import lognorm

    m, s, cap = math.log(800.0), 0.7, 65536
    d = lognorm(s, scale=math.exp(m))
    for n, q in ((0, 0.5), (0, 0.995), (300, 0.9), (2000, 0.995), (5000, 0.5)):
        sn = d.sf(n + 0.5) if n else 1.0
        want = d.isf((1 - q) * sn) - n  # P(L > n + x | L > n) = 1 - q
        assert rq(m, s, n, q, cap) == pytest.approx(want, rel=1e-6), (n, q)
    # capped at max_tokens - generated; at least 1; sd 0 is a point mass
    assert rq(math.log(1e6), s, 100, 0.995, cap) == cap - 100
    assert rq(m, s, 60000, 0.995, cap) == cap - 60000
    assert rq(m, 0.0, 900, 0.5, cap) == 1.0 and rq(m, 0.0, 300, 0.5, cap) == pytest.approx(500)


def test_seer_prompt_oracle_ranks_by_the_true_length_distributions():
    """seer's rule (probes first, then the largest remaining-length quantile) with each group's
    generating distribution in place of the fitted model: a long prompt's requests go first, and
    a started request is keyed by its conditional quantile."""
    dists = {"g0": (math.log(50.0), 0.3), "g1": (math.log(400.0), 0.3)}
    groups = make_groups(2, 3)
    p = bound("seer_prompt_oracle", groups, Hindsight(length_distributions=dists),
              estimator="posterior", quantile=0.9)
    assert p.pop().request_id == "g0/0" and p.pop().request_id == "g1/0"  # probes, as in seer
    for r in groups[0].requests[1:] + groups[1].requests[1:]:
        m, s = dists[r.group_id]
        assert p.estimate_remaining(r) == max(1, round(rq(m, s, 0, 0.9, MAX)))
    assert drain(p) == ["g1/1", "g1/2", "g0/1", "g0/2"]  # the long prompt first
    g0 = groups[0].requests[0]
    run_chunk(p, g0, 40, finished=False)
    assert p.estimate_remaining(g0) == round(rq(*dists["g0"], 40, 0.9, MAX))
    with pytest.raises(ConfigError, match="length_distributions"):
        CATALOG.make("seer_prompt_oracle").bind(make_groups(1, 2), {})
    with pytest.raises(ConfigError, match=r"no entry for 1 group\(s\), e.g. \['g1'\]"):
        CATALOG.make("seer_prompt_oracle", Hindsight(length_distributions={"g0": (1.0, 1.0)})
                     ).bind(make_groups(2, 2), {})
    with pytest.raises(ConfigError, match="estimator='max_finished' is not supported"):
        CATALOG.make("seer_prompt_oracle", Hindsight(length_distributions=dists)).bind(
            make_groups(2, 2), {"estimator": "max_finished"})


def test_oracle_first_finish_learns_a_groups_true_longest_only_when_one_response_finished():
    groups = make_groups(2, 2)
    lengths = {"g0/0": 100, "g0/1": 900, "g1/0": 200, "g1/1": 300}
    p = bound("oracle_first_finish", groups, Hindsight(true_lengths=lengths))
    # nothing finished: every group counts as max_tokens long, least generated first
    assert [p.estimate_remaining(r) for g in groups for r in g.requests] == [MAX] * 4
    a = p.pop()
    assert a.request_id == "g0/0"
    run_chunk(p, a, 100, finished=True)  # g0's true longest (900) is now known
    assert p.estimate_remaining(groups[0].requests[1]) == 900
    # g1 is still unknown (1000) and outranks g0's survivor (900)
    assert drain(p) == ["g1/0", "g1/1", "g0/1"]
    with pytest.raises(ConfigError, match="needs true lengths"):
        CATALOG.make("oracle_first_finish").bind(groups, {})


def test_oracle_conditional_max_estimates_from_groups_with_a_similar_shortest_response():
    # five groups of shortest ~100 whose longest are 200..600 (median 400), one of shortest 900
    lengths = {}
    for gi, longest in enumerate([200, 300, 400, 500, 600]):
        lengths[f"g{gi}/0"], lengths[f"g{gi}/1"] = 100 + gi, longest
    lengths["g5/0"], lengths["g5/1"] = 900, 950
    groups = make_groups(6, 2)
    p = bound("oracle_conditional_max", groups, Hindsight(true_lengths=lengths))
    assert p.conditional_max(100, MAX) == 400  # median of the five similar groups
    assert p.conditional_max(900, MAX) == MAX  # one similar group: too few, max_tokens
    first = next(r for r in (p.pop() for _ in range(12)) if r.request_id == "g4/0")
    run_chunk(p, first, 104, finished=True)
    # g4 estimated at 400 (not its true 600), raised to what a sibling has generated
    assert p.estimate_remaining(groups[4].requests[1]) == 400



def _finish(r: RequestState, n: int) -> None:
    r.output_ids.extend([7] * n)
    r.status = "done"


def test_oracle_conditional_quantile_too_little_evidence_counts_as_unknown():
    # three groups whose short response (~100) has a 900-long sibling, three of 300 / 350
    lengths = {}
    for gi in range(3):
        lengths[f"g{gi}/0"], lengths[f"g{gi}/1"] = 100 + gi, 900
    for gi in range(3, 6):
        lengths[f"g{gi}/0"], lengths[f"g{gi}/1"] = 300 + gi, 350
    groups = make_groups(6, 2)
    p = bound("oracle_conditional_quantile", groups, Hindsight(true_lengths=lengths),
              quantile=0.5)
    # nothing known: every request matches all twelve, one key for all
    assert len({p.estimate_remaining(r) for g in groups for r in g.requests}) == 1
    _finish(groups[0].requests[0], 100)
    # a sibling finished at ~100: only g0-g2's 900-long requests match, fewer than MIN_MATCHES
    assert MIN_MATCHES == 5
    assert p.estimate_remaining(groups[0].requests[1]) == MAX
    assert p.evidence(groups[0].requests[1]) == (0, 100, 100, 100)


def test_oracle_conditional_quantile_known_long_profile_outranks_known_short_profile():
    # six "hard" groups (a 100-token response and a 900-token one) and six "easy" ones (100 and
    # 150): the shortest sibling alone does not tell them apart, progress does
    lengths = {}
    for gi in range(12):
        lengths[f"g{gi}/0"], lengths[f"g{gi}/1"] = 100, (900 if gi < 6 else 150)
    groups = make_groups(12, 2)
    p = bound("oracle_conditional_quantile", groups, Hindsight(true_lengths=lengths),
              quantile=0.9)
    hard, easy, late = groups[0].requests, groups[6].requests, groups[7].requests
    for g in groups:
        assert p.pop().request_id == g.requests[0].request_id  # ties: enqueue order
        _finish(g.requests[0], 100)
        assert p.pop().request_id == g.requests[1].request_id
        p.push(g.requests[1])
    # same evidence, same key: longer than 0 with a ~100 sibling: six 900s and six 150s
    assert p.estimate_remaining(easy[1]) == p.estimate_remaining(hard[1]) == 900
    hard[1].output_ids.extend([7] * 400)
    late[1].output_ids.extend([7] * 200)
    # past 400 (or 200: it outlived the easy profile) only the 900s are consistent
    assert p.estimate_remaining(hard[1]) == 500
    assert p.estimate_remaining(late[1]) == 700
    # the key is the estimate, longest first; ties to the least generated
    for r in (hard[1], late[1]):
        p.on_chunk_end(r)
    assert drain(p)[-2:] == ["g7/1", "g0/1"]


def test_oracle_conditional_quantile_options():
    groups = make_groups(1, 2)
    lengths = {"g0/0": 5, "g0/1": 9}
    with pytest.raises(ConfigError, match="quantile=1.5 is invalid"):
        bound("oracle_conditional_quantile", groups, Hindsight(true_lengths=lengths),
              quantile=1.5)
    with pytest.raises(ConfigError, match="needs true lengths"):
        CATALOG.make("oracle_conditional_quantile").bind(groups, {})
