"""Unit tests of the production scheduling policies' ordering rules (seer paper §4.3)."""

from __future__ import annotations

import pytest

from seer_jax.analysis.policies import CATALOG, Hindsight
from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies import POLICIES, GroupState, RequestState, make_policy
from seer_jax.rollout.core.types import SamplingParams

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


def bound(name: str, groups, hindsight: Hindsight | None = None, **options):
    """`name` (production or analysis) bound to `groups` with `options`, every request pushed."""
    p = CATALOG.make(name, hindsight)
    # the paper's ordering rules are tested on its estimator; the posterior's in
    # test_seer_posterior.py
    opts = {"starvation_pops": 0, "estimator": "max_finished"} if "starvation_pops" in type(
        p).option_keys else {}
    opts.update(options)
    p.bind(groups, p.check_options(opts))
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
    assert set(POLICIES) == {"seer", "group_round_robin", "request_fcfs"}
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


def first_finisher(groups, **options):
    return bound("seer", groups, estimator="first_finisher", **options)


def test_seer_posterior_has_probes():
    groups = make_groups(2, 2)
    p = make_policy("seer")
    p.bind(groups, {"estimator": "posterior"})
    assert p.starvation_pops == 4 * 4
    assert [r.is_probe for g in groups for r in g.requests] == [True, False, True, False]
    for g in groups:
        for r in g.requests:
            p.push(r)
    # nothing known: the probes (priority 1) first, the rest first-come-first-served
    assert [p.priority(r) for g in groups for r in g.requests] == [1, 0, 1, 0]
    assert drain(p) == ["g0/0", "g1/0", "g0/1", "g1/1"]


def test_seer_default_is_hedged_fcfs_without_probes():
    groups = make_groups(2, 3)
    p = make_policy("seer")
    p.bind(groups, {})
    assert p.estimator == "hedged" and p.starvation_pops == 0 and p.model is None
    assert not any(r.is_probe for g in groups for r in g.requests)
    for g in groups:
        for r in g.requests:
            p.push(r)
    assert [p.priority(r) for g in groups for r in g.requests] == [0] * 6
    assert p.estimate_remaining(groups[0].requests[0]) is None
    assert drain(p) == ["g0/0", "g0/1", "g0/2", "g1/0", "g1/1", "g1/2"]


def test_seer_hedged_serves_lone_long_siblings_first():
    groups = make_groups(3, 4)
    p = bound("seer", groups, estimator="hedged")
    g0 = [p.pop() for _ in range(4)]
    g1 = [p.pop() for _ in range(4)]
    run_chunk(p, g0[0], 50, finished=True)
    run_chunk(p, g0[1], 100, finished=True)  # half of g0 finished, longest 100 <= 3 x 50
    run_chunk(p, g0[2], 600, finished=False)  # 600 <= 6 x 100: back of the line
    run_chunk(p, g1[0], 20, finished=True)
    run_chunk(p, g1[1], 900, finished=False)  # 900 > 6 x 20, but 1 of 4 finished: weak
    run_chunk(p, g1[2], 70, finished=True)  # g1 half finished, but 70 > 3 x 20: disagree
    assert not p.lone_long(g1[1])
    run_chunk(p, g0[3], 601, finished=False)  # 601 > 6 x 100, half finished: served first
    run_chunk(p, g1[3], 100, finished=False)
    assert p.lone_long(g0[3]) and not p.lone_long(g0[2])
    assert drain(p) == ["g0/3", "g2/0", "g2/1", "g2/2", "g2/3", "g0/2", "g1/1", "g1/3"]


def test_seer_hedged_rekeys_siblings_when_their_group_finishes_more():
    groups = make_groups(2, 4)
    p = bound("seer", groups, estimator="hedged")
    a, b, c, _ = (p.pop() for _ in range(4))  # g0/0..3
    run_chunk(p, a, 100, finished=True)
    run_chunk(p, b, 800, finished=False)  # 1 of 4 finished: back of the line
    assert not p.lone_long(b)
    run_chunk(p, c, 120, finished=True)  # 2 of 4 finished, longest 120: b (800) is lone long
    assert p.lone_long(b)
    assert drain(p) == ["g0/1", "g1/0", "g1/1", "g1/2", "g1/3"]


def test_first_finisher_known_long_and_unknown_outrank_fresh_known_short():
    # N = 9 requests, defer = 1.0: a deferred request moves back 9 places
    groups = make_groups(3, 3)
    p = first_finisher(groups, defer=1.0)
    a, b = p.pop(), p.pop()  # g0/0, g0/1
    c = p.pop()  # g0/2
    run_chunk(p, a, 50, finished=True)  # g0's first finisher: 50 < 0.1875 * MAX -> short
    d = p.pop()  # g1/0
    run_chunk(p, d, 600, finished=True)  # g1's first finisher is long: g1 is never deferred
    # b, c come back after a chunk of 40 tokens each (<= 2 x 50: still deferred)
    run_chunk(p, b, 40, finished=False)
    run_chunk(p, c, 40, finished=False)
    assert p.deferred(b) and p.deferred(c)
    assert not any(p.deferred(r) for r in groups[1].requests + groups[2].requests)
    # g1 (known long) and g2 (unknown) requests first in enqueue order, then g0's deferred ones
    assert drain(p) == ["g1/1", "g1/2", "g2/0", "g2/1", "g2/2", "g0/1", "g0/2"]


def test_first_finisher_never_defers_a_request_past_twice_the_shortest():
    # the guarantee: once a request has generated more than 2 x its group's shortest finished
    # length it is placed like any request of an unknown group (enqueue order + progress only)
    groups = make_groups(2, 3)
    p = first_finisher(groups, defer=1.0)
    a, b, c = p.pop(), p.pop(), p.pop()  # g0/0, g0/1, g0/2
    run_chunk(p, a, 50, finished=True)  # g0 short (50)
    run_chunk(p, b, 100, finished=False)  # 100 = 2 x 50: still deferred
    run_chunk(p, c, 101, finished=False)  # 101 > 2 x 50: the lone long sibling
    assert p.deferred(b) and not p.deferred(c)
    n = len(p.requests)
    assert p.place(c) == c.enqueue_seq + n * 101 / (2 * MAX)
    assert p.place(b) == b.enqueue_seq + n * 100 / (2 * MAX) + 1.0 * n
    # c re-entered the buffer after g1's fresh requests and is behind them, b is behind all
    assert drain(p) == ["g1/0", "g1/1", "g1/2", "g0/2", "g0/1"]


def test_first_finisher_ties_go_to_the_lower_enqueue_number():
    # N = 4, defer = 0.5: g0/1 (enqueued 2nd) deferred by 2 places ties with g1/1 (enqueued 4th)
    groups = make_groups(2, 2)
    p = first_finisher(groups, defer=0.5)
    a = p.pop()  # g0/0
    run_chunk(p, a, 10, finished=True)
    b0, b1 = groups[0].requests[1], groups[1].requests[1]
    assert p.place(b0) == p.place(b1) == 4.0
    assert drain(p) == ["g1/0", "g0/1", "g1/1"]


def test_first_finisher_progress_lets_fresher_requests_pass():
    # a request that has generated more is placed N * generated / (2 * max_tokens) further back
    groups = make_groups(1, 4)
    p = first_finisher(groups)
    r = p.pop()  # g0/0, enqueue 1
    run_chunk(p, r, MAX // 2, finished=False)  # back in line at 5 + 4 * 0.25 = 6
    assert p.place(r) == 5 + 1.0
    assert drain(p) == ["g0/1", "g0/2", "g0/3", "g0/0"]


def test_first_finisher_stops_deferring_when_siblings_are_far_apart():
    # 21 groups of 2: each finishes one response at 10 tokens and one at 300 (log sd 2.4 >
    # 0.5): a first finisher says nothing about its siblings, so nothing is deferred any more
    groups = make_groups(22, 2)
    p = first_finisher(groups)
    for g in groups[:21]:
        a, b = g.requests
        for r in (a, b):
            r.in_buffer = False
            p.size -= 1
        run_chunk(p, a, 10, finished=True)
        if g.index == 0:
            assert p.deferred(b)  # 10 < 0.1875 * MAX: short, and no spread measured yet
        run_chunk(p, b, 300, finished=True)
    c = groups[21].requests[0]
    c.in_buffer = False
    p.size -= 1
    run_chunk(p, c, 10, finished=True)
    assert not p.deferred(groups[21].requests[1])


def test_first_finisher_options_are_checked():
    groups = make_groups(1, 2)
    with pytest.raises(ConfigError, match="short_fraction"):
        make_policy("seer").bind(groups, {"short_fraction": 1.5})
    with pytest.raises(ConfigError, match="defer"):
        make_policy("seer").bind(groups, {"defer": -1})


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


def test_policy_flags():
    assert POLICIES["group_round_robin"].divided is False
    assert POLICIES["group_round_robin"].kv_admission is False
    for name in ("seer", "request_fcfs"):
        assert POLICIES[name].divided and POLICIES[name].kv_admission
    for name in ("oracle_lfs", "oracle_group_lfs", "seer_running_oracle", "seer_prompt_oracle"):
        assert CATALOG.classes[name].divided and CATALOG.classes[name].kv_admission
