"""Two partial-rollout calls on real engines (in process or Ray actors), checked the same way:
the first returns once one group is complete and carries the others, the second runs them to
completion; every request is returned exactly once with the uninterrupted run's greedy tokens."""

from __future__ import annotations

from collections.abc import Callable

from seer_jax.model.generate import generate
from seer_jax.rollout.core.carry import CarryOver
from seer_jax.rollout.core.types import SamplingParams
from tests.rollout.tiny_rollout import CFG, GROUPS, PARAMS

GREEDY = SamplingParams(temperature=0.0)
G, MAX = 3, 30
REQUEST_IDS = sorted(f"c0g{g}/{j}" for g in range(len(GROUPS)) for j in range(G))
# one chunk in flight per instance: the first group completes while the others are part-way
CONFIG = {"chunk_size": 8, "max_in_flight_per_instance": 1}


def reference() -> dict[tuple[int, ...], list[int]]:
    """prompt -> its uninterrupted greedy response."""
    return {tuple(p): r.token_ids for p, r in zip(GROUPS, generate(PARAMS, CFG, GROUPS, MAX),
                                                   strict=True)}


def two_calls(call: Callable, ref: dict, sync: Callable[[], None] | None = None):
    """call(groups, carry, target_groups, weight_version) -> RolloutOutput. Returns (first,
    second, tokens each carried unfinished request had after the first call); `sync` runs
    between the calls and bumps the weight version."""
    carry = CarryOver()
    first = call(GROUPS, carry, 1, 0)
    carried = {rec.request_id: len(rec.token_ids) for g in carry.groups for rec in g.records
               if rec.finish_reason is None}
    assert carried and any(carried.values()), carried  # some carried part-way
    version = 0
    if sync is not None:
        sync()
        version = 1
    second = call([], carry, None, version)
    assert len(carry) == 0
    both = first.results + second.results
    assert sorted(r.request_id for r in both) == REQUEST_IDS  # each exactly once
    for r in both:
        assert r.token_ids == ref[tuple(r.prompt_ids)], r.request_id
        assert sum(n for _, n in r.weight_versions) == len(r.token_ids)
    assert set(carried) <= {r.request_id for r in second.results}
    return first, second, carried


def check_kv_reuse(second, carried: dict[str, int], synced: bool) -> None:
    """Without a sync a carried request continues from its KV in the pool (nothing re-prefilled);
    after one its KV is stale, so it re-prefills prompt + carried tokens."""
    partway = [r for r in second.results if carried.get(r.request_id)]
    assert partway
    for r in partway:
        n = carried[r.request_id]
        if synced:
            assert r.reprefill_tokens >= len(r.prompt_ids) + n, r.request_id
            assert r.weight_versions == [[0, n], [1, len(r.token_ids) - n]], r.request_id
        else:
            assert r.reprefill_tokens == 0, r.request_id
            assert r.weight_versions == [[0, len(r.token_ids)]], r.request_id
    if synced:
        assert second.report.reprefill_chunks >= len(partway)
    else:
        assert second.report.kv_bytes_imported > 0
