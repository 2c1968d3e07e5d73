"""Placement rules: affinity while balanced, least in-flight when unbalanced, KV-budget fit."""

from __future__ import annotations

from seer_jax.rollout.core.placement import InstanceSlot, choose_instance


def slots(in_flight, reserved=None, total=100):
    reserved = reserved or [0] * len(in_flight)
    return [
        InstanceSlot(i, total_pages=total, page_size=16, in_flight=f, reserved_pages=r)
        for i, (f, r) in enumerate(zip(in_flight, reserved, strict=True))
    ]


def pick(ss, resident, need=10, threshold=32, kv=True):
    s = choose_instance(ss, lambda s: need, lambda s: resident[s.instance_id], threshold, kv)
    return None if s is None else s.instance_id


def test_affinity_wins_while_balanced():
    ss = slots([10, 30, 5])
    assert pick(ss, [0, 500, 0]) == 1  # spread 25 <= 32: go where the KV is
    assert pick(ss, [0, 0, 0]) == 2  # no affinity: fewest in flight


def test_least_loaded_when_spread_exceeds_threshold():
    ss = slots([10, 50, 5])
    assert pick(ss, [0, 500, 0]) == 2  # spread 45 > 32
    assert pick(ss, [0, 500, 0], threshold=100) == 1
    ss = slots([5, 50, 5])
    assert pick(ss, [0, 0, 7]) == 2  # tie on in-flight -> more resident tokens


def test_only_instances_with_kv_budget_are_candidates():
    ss = slots([1, 1, 1], reserved=[95, 50, 100])
    assert pick(ss, [900, 0, 900], need=10) == 1
    assert pick(ss, [0, 0, 0], need=60) is None
    assert pick(ss, [0, 0, 0], need=60, kv=False) == 0  # overcommitting policies ignore it
    ss[1].blocked_pages = 45  # held back for a higher-priority request this round
    assert pick(ss, [0, 0, 0], need=10) is None


def test_lost_instances_and_in_flight_cap():
    ss = slots([0, 0])
    ss[0].alive = False
    assert pick(ss, [100, 0]) == 1
    ss[1].max_in_flight = 0
    assert pick(ss, [0, 0]) is None
