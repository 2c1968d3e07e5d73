"""Partial rollout across calls on simulated instances: a call returns once `target_groups` groups
are complete, the others carry over (tokens, seeds, KV while the weights stay), nothing is lost
or returned twice, and every token's weight version is recorded."""

from __future__ import annotations

import pytest

from seer_jax.errors import ConfigError, InputError
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.core.carry import CarryOver, version_stats
from seer_jax.rollout.core.run import rollout
from seer_jax.sim.instance import expected_output, make_sim_instances
from tests.rollout.test_controller import workload

G, MAX = 3, 96


def batches(n_batches, per_batch):
    """`n_batches` batches of prompts, and the true lengths under the ids each call gives them."""
    prompts, lengths = workload(n_batches * per_batch, G, MAX, seed=5, sigma=1.2)
    out, true = [], {}
    for b in range(n_batches):
        out.append(prompts[b * per_batch:(b + 1) * per_batch])
        for i in range(per_batch):
            for j in range(G):
                true[f"c{b}g{i}/{j}"] = lengths[f"g{b * per_batch + i}/{j}"]
    return out, true


def call(carry, prompts, lengths, pool, target, version, policy="seer"):
    insts = make_sim_instances(2, lengths, pool=pool, kv_capacity_pages=64, page_size=16)
    return rollout(prompts, group_size=G, max_tokens=MAX, instances=insts, policy=policy,
                   pool=pool, config={"chunk_size": 16}, carry=carry, target_groups=target,
                   weight_version=version)


@pytest.mark.parametrize("policy", ["seer", "request_fcfs"])
def test_carried_groups_finish_later_with_mixed_versions_none_lost_or_duplicated(policy):
    prompts, lengths = batches(3, 6)
    pool = HostKVPool()
    carry = CarryOver()
    returned = {}
    version = 0
    for b in range(3):
        out = call(carry, prompts[b], lengths, pool, target=4, version=version, policy=policy)
        groups = {r.group_id for r in out.results}
        assert len(groups) >= 4 and len(out.results) == G * len(groups)  # whole groups only
        for r in out.results:
            assert r.request_id not in returned  # never returned twice
            returned[r.request_id] = (r, version)
        version += 1  # a weight sync between iterations
    assert len(carry) > 0 and carry.unfinished_requests > 0
    carried_ids = {rec.request_id for g in carry.groups for rec in g.records}
    last = call(carry, [], lengths, pool, target=None, version=version, policy=policy)
    assert len(carry) == 0
    for r in last.results:
        assert r.request_id not in returned
        returned[r.request_id] = (r, version)
    assert set(returned) == set(lengths)  # none lost
    assert carried_ids <= {r.request_id for r in last.results}
    mixed = 0
    for rid, (r, v) in returned.items():
        tokens, reason = expected_output(rid, lengths[rid], MAX)
        assert (r.token_ids, r.finish_reason) == (tokens, reason), rid
        assert sum(n for _, n in r.weight_versions) == len(r.token_ids)
        assert all(ver <= v for ver, _ in r.weight_versions)
        mixed += len(r.weight_versions) > 1
    assert mixed > 0  # responses that spanned a weight sync say so
    stats = version_stats([r for r, _ in returned.values()], version)
    assert 0 < stats["off_policy_share"] < 1


def test_kv_is_reused_while_the_weights_stay_and_dropped_after_a_sync():
    prompts, lengths = batches(1, 6)
    for new_version, reused in ((0, True), (1, False)):
        pool = HostKVPool()
        carry = CarryOver()
        call(carry, prompts[0], lengths, pool, target=2, version=0)
        held = [h for g in carry.groups for h, _ in g.kv.values()]
        assert held and all(pool.get(h) is not None for h in held)
        out = call(carry, [], lengths, pool, target=None, version=new_version)
        assert out.report.kv_bytes_imported > 0 or not reused
        assert (out.report.reprefill_chunks == 0) == reused
        if not reused:  # the stale KV left the pool
            assert all(pool.get(h) is None for h in held)


def test_without_carry_target_groups_is_refused_and_default_waits_for_all():
    prompts, lengths = batches(1, 4)
    pool = HostKVPool()
    with pytest.raises(ConfigError, match="target_groups=2 without carry is invalid"):
        rollout(prompts[0], group_size=G, max_tokens=MAX,
                instances=make_sim_instances(2, lengths, pool=pool), target_groups=2)
    with pytest.raises(ConfigError, match=r"target_groups=5 is invalid; allowed: None .* 1\.\.4"):
        call(CarryOver(), prompts[0], lengths, pool, target=5, version=0)
    with pytest.raises(ConfigError, match="policy 'group_round_robin' is invalid: it runs each "):
        call(CarryOver(), prompts[0], lengths, pool, target=2, version=0,
             policy="group_round_robin")
    carry = CarryOver()
    out = call(carry, prompts[0], lengths, pool, target=None, version=0)
    assert len(out.results) == 4 * G and len(carry) == 0
    partial = CarryOver()
    prompts6, lengths6 = batches(1, 6)
    call(partial, prompts6[0], lengths6, pool, target=2, version=0)
    assert len(partial) > 0
    with pytest.raises(InputError, match=r"group_size=2 but the carried groups have \[3\]"):
        rollout([], group_size=2, max_tokens=MAX, pool=pool, carry=partial,
                instances=make_sim_instances(2, lengths6, pool=pool))
