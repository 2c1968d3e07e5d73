"""Unit tests of the scheduling policies' ordering rules (seer paper §4.3, DESIGN.md §2.2)."""

from __future__ import annotations

import math

import pytest

from seer_jax.errors import ConfigError
from seer_jax.rollout.policies import POLICIES, GroupState, RequestState, make_policy
from seer_jax.rollout.policies.seer_prompt_oracle import lognormal_remaining_quantile as rq
from seer_jax.rollout.types import SamplingParams

MAX = 1000


def make_groups(n_groups: int, group_size: int, max_tokens: int = MAX) -> list[GroupState]:
    groups = []
    for gi in range(n_groups):
        g = GroupState(f"g{gi}", gi, max_tokens)
        for j in range(group_size):
            g.requests.append(
                RequestState(f"g{gi}/{j}", g, j, (1, 2, 3), SamplingParams(), max_tokens)
            )
        groups.append(g)
    return groups


def bound(name: str, groups, **options):
    p = make_policy(name)
    # the paper's ordering rules are tested on its estimator; the posterior's in
    # test_seer_posterior.py
    opts = {"oracle_lengths": None, "starvation_pops": 0, "estimator": "max_finished"}
    opts.update(options)
    p.bind(groups, opts)
    for g in groups:
        for r in g.requests:
            p.push(r)
    return p


def run_chunk(p, req: RequestState, tokens: int, finished: bool) -> None:
    """What the controller does when a chunk of `req` ends (req was popped before)."""
    req.output_ids.extend([7] * tokens)
    if finished:
        req.group.record_finished(req)
        p.on_request_finished(req)
    else:
        req.group.record_progress(req)
        p.on_chunk_end(req)
        p.push(req)


def drain(p) -> list[str]:
    out = []
    while (r := p.pop()) is not None:
        out.append(r.request_id)
    return out


def test_registry_names_and_unknown_policy():
    assert set(POLICIES) == {"seer", "group_round_robin", "request_fcfs", "oracle_lfs",
                             "oracle_group_lfs", "seer_running_oracle", "seer_prompt_oracle"}
    with pytest.raises(ConfigError) as e:
        make_policy("lifo")
    assert "lifo" in str(e.value) and "seer" in str(e.value)


def test_seer_probes_first_one_per_group():
    groups = make_groups(3, 4)
    p = bound("seer", groups)
    first = [p.pop().request_id for _ in range(3)]
    assert first == ["g0/0", "g1/0", "g2/0"]
    assert all(groups[i].requests[0].is_probe for i in range(3))
    assert p.priority(groups[0].requests[0]) == 1 and p.priority(groups[0].requests[1]) == 0


def test_seer_probes_are_shortest_generated_first():
    groups = make_groups(3, 2)
    p = bound("seer", groups)
    probes = [p.pop() for _ in range(3)]
    # probes come back unfinished with different progress: 300, 100, 200 tokens
    for r, n in zip(probes, (300, 100, 200), strict=True):
        run_chunk(p, r, n, finished=False)
    order = [p.pop().request_id for _ in range(3)]
    assert order == ["g1/0", "g2/0", "g0/0"]


def test_seer_unknown_groups_are_assumed_long_and_lfs_follows_estimates():
    groups = make_groups(3, 3)
    p = bound("seer", groups)
    probes = [p.pop() for _ in range(3)]
    run_chunk(p, probes[0], 50, finished=True)  # g0 short
    run_chunk(p, probes[1], 400, finished=True)  # g1 long
    # g2 unknown: its siblings are assumed max_tokens long and go first, then g1 (400), then g0 (50)
    run_chunk(p, probes[2], 100, finished=False)
    assert groups[2].length_estimate == MAX
    assert groups[1].length_estimate == 400 and groups[0].length_estimate == 50
    order = drain(p)
    assert order[0] == "g2/0"  # the unfinished probe is still in the probe class
    assert order[1:3] == ["g2/1", "g2/2"]
    assert order[3:] == ["g1/1", "g1/2", "g0/1", "g0/2"]


def test_seer_estimate_updates_as_siblings_finish():
    groups = make_groups(2, 3)
    p = bound("seer", groups)
    a0, b0 = p.pop(), p.pop()
    run_chunk(p, a0, 100, finished=True)  # L_g0 = 100
    run_chunk(p, b0, 200, finished=True)  # L_g1 = 200
    nxt = p.pop()
    assert nxt.request_id == "g1/1"
    # a sibling of g0 finishes long: g0's estimate rises to 500 and its buffered sibling jumps ahead
    g0_1 = groups[0].requests[1]
    g0_1.in_buffer = False  # pretend it ran elsewhere (pulled out of the buffer)
    p.size -= 1
    run_chunk(p, g0_1, 500, finished=True)
    assert groups[0].length_estimate == 500
    assert p.pop().request_id == "g0/2"
    assert p.pop().request_id == "g1/2"
    assert p.pop() is None


def test_seer_estimate_raised_by_running_sibling_progress():
    groups = make_groups(2, 3)
    p = bound("seer", groups)
    a0, b0 = p.pop(), p.pop()
    run_chunk(p, a0, 10, finished=True)  # g0: 10
    run_chunk(p, b0, 300, finished=True)  # g1: 300
    a1 = p.pop()  # g1/1 first (300 > 10)
    assert a1.request_id == "g1/1"
    g0_1 = p.pop()
    assert g0_1.request_id == "g1/2"
    g0_1 = p.pop()
    assert g0_1.request_id == "g0/1"
    # g0/1 has generated 600 tokens and is still going: g0 is at least 600 long
    run_chunk(p, g0_1, 600, finished=False)
    assert groups[0].length_estimate == 600
    assert p.pop().request_id == "g0/1"


def test_seer_probe_leaves_probe_class_once_group_has_estimate():
    groups = make_groups(2, 2)
    p = bound("seer", groups)
    probe0 = p.pop()
    run_chunk(p, probe0, 100, finished=False)  # back in probe queue
    g0_1 = groups[0].requests[1]
    g1 = p.pop()  # next probe: g1/0
    assert g1.request_id == "g1/0"
    # g0/1 popped and finished before its probe
    assert p.pop().request_id == "g0/0"  # probe (SFS) before the LFS class
    p.push(probe0, requeue=True)
    nxt = p.pop()
    assert nxt is probe0
    p.push(probe0, requeue=True)
    assert g0_1.in_buffer
    g0_1.in_buffer = False
    p.size -= 1
    run_chunk(p, g0_1, 30, finished=True)
    assert not p.probe_active(probe0) and p.priority(probe0) == 0
    # remaining: g1/1 (unknown group: assumed max_tokens) then g0/0 (L=max(30, 100)=100)
    assert drain(p) == ["g1/1", "g0/0"]


def test_seer_starvation_guard_serves_old_requests():
    groups = make_groups(1, 1) + make_groups(1, 1)
    groups[1].group_id, groups[1].index = "g1", 1
    groups[1].requests[0].request_id = "g1/0"
    # g0 known short, g1 long: new g1 work keeps arriving; g0's request must not wait forever
    p = make_policy("seer")
    p.bind(groups, {"starvation_pops": 3, "estimator": "max_finished"})
    a, b = groups[0].requests[0], groups[1].requests[0]
    a.is_probe = b.is_probe = False
    groups[0].finished_max_len, groups[1].finished_max_len = 10, 900
    p.push(a)
    served = []
    for _ in range(6):
        p.push(b)
        r = p.pop()
        served.append(r.request_id)
        if r is a:
            break
    assert served[:4] == ["g1/0"] * 4 and served[4] == "g0/0"
    assert p.starved_pops == 1


def test_seer_without_guard_is_strict_lfs():
    groups = make_groups(2, 1)
    p = make_policy("seer")
    p.bind(groups, {"starvation_pops": 0, "estimator": "max_finished"})
    a, b = groups[0].requests[0], groups[1].requests[0]
    a.is_probe = b.is_probe = False
    groups[0].finished_max_len, groups[1].finished_max_len = 10, 900
    p.push(a)
    for _ in range(20):
        p.push(b)
        assert p.pop() is b
    assert p.pop() is a


def test_requeue_keeps_place_in_line():
    groups = make_groups(1, 3)
    p = bound("request_fcfs", groups)
    r0 = p.pop()
    p.push(r0, requeue=True)
    assert drain(p) == ["g0/0", "g0/1", "g0/2"]


def test_request_fcfs_is_first_come_first_served():
    groups = make_groups(2, 2)
    p = bound("request_fcfs", groups)
    r = p.pop()
    assert r.request_id == "g0/0"
    run_chunk(p, r, 10, finished=False)  # goes to the back
    assert drain(p) == ["g0/1", "g1/0", "g1/1", "g0/0"]


def test_oracle_lfs_orders_by_true_remaining_length():
    groups = make_groups(2, 2)
    lengths = {"g0/0": 50, "g0/1": 700, "g1/0": 5000, "g1/1": 300}
    p = bound("oracle_lfs", groups, oracle_lengths=lengths)
    first = p.pop()
    assert first.request_id == "g1/0"  # min(5000, max_tokens)=1000 remaining
    run_chunk(p, first, 900, finished=False)  # 100 left now
    assert drain(p) == ["g0/1", "g1/1", "g1/0", "g0/0"]


def test_oracle_lfs_needs_lengths():
    groups = make_groups(1, 2)
    with pytest.raises(ConfigError, match="oracle_lengths"):
        make_policy("oracle_lfs").bind(groups, {"oracle_lengths": None})
    with pytest.raises(ConfigError, match="no length for 1"):
        make_policy("oracle_lfs").bind(groups, {"oracle_lengths": {"g0/0": 3}})


def test_oracle_group_lfs_knows_each_groups_longest_response_not_which_sibling():
    groups = make_groups(2, 3)
    lengths = {"g0/0": 50, "g0/1": 900, "g0/2": 40, "g1/0": 600, "g1/1": 500, "g1/2": 550}
    p = bound("oracle_group_lfs", groups, oracle_lengths=lengths)
    # g0's longest is 900 > g1's 600: all of g0 first, in arrival order (it cannot tell that
    # g0/1 is the long one), then g1
    first = p.pop()
    assert first.request_id == "g0/0"
    assert p.estimate_remaining(first) == 900
    run_chunk(p, first, 400, finished=False)  # 500 left of g0's 900: now below g1's 600
    assert drain(p) == ["g0/1", "g0/2", "g1/0", "g1/1", "g1/2", "g0/0"]
    with pytest.raises(ConfigError, match="oracle_lengths"):
        make_policy("oracle_group_lfs").bind(groups, {"oracle_lengths": None})


def test_seer_running_oracle_keys_started_requests_by_their_groups_true_longest():
    """Fresh requests are ranked as seer ranks them (posterior quantile); a request that has
    generated tokens is keyed by its group's true longest length minus what it generated."""
    lengths = {"g0/0": 100, "g0/1": 120, "g0/2": 900, "g1/0": 300, "g1/1": 350, "g1/2": 320}
    opts = {"oracle_lengths": lengths, "starvation_pops": 0}
    gp, gr = make_groups(2, 3), make_groups(2, 3)  # same state, one per policy
    p = bound("seer_running_oracle", gp, estimator="posterior", **opts)
    ref = bound("seer", gr, estimator="posterior", **opts)

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
    with pytest.raises(ConfigError, match="oracle_lengths"):
        make_policy("seer_running_oracle").bind(make_groups(1, 2), {"oracle_lengths": None})
    with pytest.raises(ConfigError, match="estimator='max_finished' is not supported"):
        make_policy("seer_running_oracle").bind(
            make_groups(2, 3), {"oracle_lengths": lengths, "estimator": "max_finished"})


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
    p = bound("seer_prompt_oracle", groups, estimator="posterior", quantile=0.9,
              length_distributions=dists)
    assert p.pop().request_id == "g0/0" and p.pop().request_id == "g1/0"  # probes, as in seer
    for r in groups[0].requests[1:] + groups[1].requests[1:]:
        m, s = dists[r.group_id]
        assert p.estimate_remaining(r) == max(1, round(rq(m, s, 0, 0.9, MAX)))
    assert drain(p) == ["g1/1", "g1/2", "g0/1", "g0/2"]  # the long prompt first
    g0 = groups[0].requests[0]
    run_chunk(p, g0, 40, finished=False)
    assert p.estimate_remaining(g0) == round(rq(*dists["g0"], 40, 0.9, MAX))
    with pytest.raises(ConfigError, match="length_distributions"):
        make_policy("seer_prompt_oracle").bind(make_groups(1, 2), {})
    with pytest.raises(ConfigError, match=r"no entry for 1 group\(s\), e.g. \['g1'\]"):
        make_policy("seer_prompt_oracle").bind(make_groups(2, 2),
                                               {"length_distributions": {"g0": (1.0, 1.0)}})
    with pytest.raises(ConfigError, match="estimator='max_finished' is not supported"):
        make_policy("seer_prompt_oracle").bind(
            make_groups(2, 2), {"length_distributions": dists, "estimator": "max_finished"})


def test_policy_flags():
    assert POLICIES["group_round_robin"].divided is False
    assert POLICIES["group_round_robin"].kv_admission is False
    for name in ("seer", "request_fcfs", "oracle_lfs", "oracle_group_lfs", "seer_running_oracle",
                 "seer_prompt_oracle"):
        assert POLICIES[name].divided and POLICIES[name].kv_admission
    assert [n for n, c in POLICIES.items() if c.needs_length_distributions] == [
        "seer_prompt_oracle"]
