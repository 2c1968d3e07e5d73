"""Grouped speculative decoding on Ray actors with the distributed draft service, on one local
loopback cluster (module-scoped): greedy tokens equal in-process speculation and no speculation
(with requests migrated through the object store, stale replicas and a two-host slice), the
sampled distribution is unchanged, and a killed draft-service shard or engine actor loses
nothing."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
from seer_jax.drafting.replicated import SyncConfig
from seer_jax.drafting.service import InProcessDraftService
from seer_jax.engine.speculation import Speculator
from seer_jax.model.generate import generate
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.core.concurrent_driver import FaultPlan
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams
from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS
from tests.subprocess_env import compilation_cache_env

# a Ray cluster and engines: make test runs these (on the worker that holds the cluster),
# test-fast does not
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

REQUEST_IDS = sorted(f"g{g}/{j}" for g in range(4) for j in range(3))
GREEDY = SamplingParams(temperature=0.0)
SPEC_ENGINE = dataclasses.replace(ENGINE, num_pages=96, speculation=True)


def always_on():
    """A budget whose step time is flat in gamma: speculation always pays (built on the actor;
    a nested function so that it travels by value)."""
    def make():
        return SpeculationBudget(lambda b, g: 1.0, BudgetConfig(beta_init=0.9))
    return make


@pytest.fixture(scope="module")
def backend():
    # the actors load the executables that this run's other processes compiled (the test
    # session's persistent compilation cache, tests/conftest.py), and later actors those of
    # the first ones
    return RayBackendConfig(step_timeout_s=120.0, env=compilation_cache_env())


@pytest.fixture(scope="module")
def actors(ray_cluster, backend):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=SPEC_ENGINE,
                               backend=backend, spec_budget=always_on(),
                               draft_service=SyncConfig(shards=2))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def reference():
    return generate(PARAMS, CFG, GROUPS, 30)


def _ray_rollout(group, policy, fault=None, sampling=GREEDY):
    group.reset()
    out = rollout(GROUPS, group_size=3, max_tokens=30, instances=group.instances,
                  sampling=sampling, policy=policy, pool=group.pool, config={"chunk_size": 8},
                  clock="concurrent", fault=fault)
    out.report.draft_service = group.draft_stats()
    return out


def _inprocess_rollout(policy, speculation):
    pool = HostKVPool()
    specs = None
    if speculation:
        service = InProcessDraftService()
        specs = [Speculator(service, always_on()()) for _ in range(2)]
    insts = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1,
                                  engine_config=SPEC_ENGINE if speculation else ENGINE,
                                  pool=pool, devices=jax.devices()[:2], speculators=specs)
    return rollout(GROUPS, group_size=3, max_tokens=30, instances=insts, sampling=GREEDY,
                   policy=policy, pool=pool, config={"chunk_size": 8}, clock="concurrent")


def _assert_complete_and_greedy(out, reference):
    assert sorted(r.request_id for r in out.results) == REQUEST_IDS  # each exactly once
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id


# seer's placement moves a group's requests between the actors (migrations, remote draft
# tokens); the other policies' runs, only through other placements, are in make test-all
@pytest.mark.parametrize("policy", [
    "seer", pytest.param("request_fcfs", marks=pytest.mark.exhaustive),
    pytest.param("group_round_robin", marks=pytest.mark.exhaustive)])
def test_greedy_tokens_with_ray_speculation_equal_plain(actors, reference, policy):
    out = _ray_rollout(actors, policy)
    _assert_complete_and_greedy(out, reference)  # == no speculation (the model's greedy tokens)
    if policy != "seer":  # and == in-process speculation's, request by request
        spec = _inprocess_rollout(policy, speculation=True)
        assert [r.token_ids for r in out.results] == [r.token_ids for r in spec.results]
    assert out.report.spec_accepted > 0 and out.report.spec_proposed >= out.report.spec_accepted
    ds = out.report.draft_service
    assert ds["lost_shards"] == 0 and ds["rebuilt_shards"] == 0
    rep = ds["replicas"]
    assert rep["pushes"] > 0 and rep["bytes_pushed"] > 0 and rep["bytes_pulled"] > 0
    if policy != "group_round_robin":  # a group's requests ran on both actors
        assert rep["remote_tokens"] > 0  # drafts saw the other actor's tokens
    if policy == "seer":  # chunks continued on the other actor from the object store
        assert out.report.migrations > 0 and out.report.kv_bytes_imported > 0
    _assert_groups_closed(actors)


def _assert_groups_closed(group):
    """Every group was closed when its last request finished: the shards, the replicas and the
    controller's record hold nothing of the rollout (their memory is back to its baseline)."""
    import ray

    draft = group.draft
    assert draft.record == {} and draft.closed_groups == len(GROUPS)
    for st in ray.get([h.stats.remote() for h in draft.spec.shards]):
        assert (st["groups"], st["messages"], st["tokens"], st["held"]) == (0, 0, 0, 0), st
    for snap in ray.get([inst.actor.snapshot.remote() for inst in group.instances]):
        assert snap.draft["groups"] == 0 and snap.resident == {}


@pytest.mark.exhaustive  # drafts never change greedy tokens: the forced-draft engine tests
def test_stale_replicas_verify_losslessly(actors, reference):
    """Replicas pull every 2nd step and wait only for pulls 3 steps old: drafts miss the other
    actor's recent tokens, never a token of the output."""
    draft = actors.draft
    old = draft.sync
    stale = SyncConfig(shards=2, max_stale_steps=3, sync_every_steps=2)
    draft.sync = draft.spec.sync = stale
    for inst in actors.instances:  # the next engines (built by reset) sync this way
        inst.actor.set_draft_sync.remote(stale)
    try:
        out = _ray_rollout(actors, "seer")
        _assert_complete_and_greedy(out, reference)
        assert out.report.spec_accepted > 0
    finally:
        draft.sync = draft.spec.sync = old
        for inst in actors.instances:
            inst.actor.set_draft_sync.remote(old)


def test_killed_draft_shard_is_rebuilt_and_no_token_changes(actors, reference):
    actors.draft.fault_after_chunks = 3
    try:
        out = _ray_rollout(actors, "seer")
    finally:
        actors.draft.fault_after_chunks = -1
    _assert_complete_and_greedy(out, reference)
    ds = out.report.draft_service
    assert ds["lost_shards"] == 1 and ds["rebuilt_shards"] == 1
    assert ds["replicas"]["shard_failures"] >= 1 and ds["replicas"]["shards_replaced"] >= 1
    assert out.report.summary()["draft_shards_rebuilt"] == 1
    # the rebuilt shard serves the next rollout
    out = _ray_rollout(actors, "seer")
    _assert_complete_and_greedy(out, reference)
    assert out.report.draft_service["replicas"]["shard_failures"] == 0


# losslessness is the engine's (tests/engine/test_speculative_engine.py checks it in process);
# this checks it again through Ray's draft service (make test-all)
@pytest.mark.exhaustive
def test_sampled_distribution_unchanged_by_ray_speculation(ray_cluster, backend):
    """T=1 on a 12-token model: the 2nd and 3rd tokens of many sampled responses, drafted from
    their siblings on two Ray actors (drafts both accepted and rejected), follow the same
    distribution as plain sampling in this process (chi-square)."""
    from scipy import stats

    from seer_jax.engine.engine import Engine
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    cfg = tiny_config(vocab_size=12, eos_token_ids=(), hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, init_params(cfg, seed=4))
    prompt, groups, size = [1, 5, 7], 12, 48
    ec = dataclasses.replace(SPEC_ENGINE, num_pages=512, page_size=4, max_num_seqs=64,
                             max_num_batched_tokens=256, max_prefill_seqs=8)
    group = make_ray_instances(cfg, params, num_instances=2, tp=1, engine_config=ec,
                               backend=backend, spec_budget=always_on())
    try:
        out = rollout([prompt] * groups, group_size=size, max_tokens=3, instances=group.instances,
                      sampling=SamplingParams(temperature=1.0, seed=7), policy="seer",
                      pool=group.pool, config={"chunk_size": 3}, clock="concurrent")
    finally:
        group.shutdown()
    n = groups * size
    assert len(out.results) == n
    assert 0 < out.report.spec_accepted < out.report.spec_proposed  # right and wrong drafts
    eng = Engine(cfg, params, dataclasses.replace(ec, speculation=False))
    for i in range(n):
        eng.add_request(str(i), prompt, 3, SamplingParams(temperature=1.0, seed=5000 + i))
    plain = eng.run_until_done()
    for pos in (1, 2):
        a = np.bincount([plain[str(i)].token_ids[pos] for i in range(n)], minlength=12)
        b = np.bincount([r.token_ids[pos] for r in out.results], minlength=12)
        keep = (a + b) > 0
        _, p, _, _ = stats.chi2_contingency(np.stack([a[keep], b[keep]]))
        assert p > 0.001, (pos, a, b)


@pytest.mark.exhaustive  # the two-host slice itself: test_ray_backend.py (make test runs it)
def test_two_host_slice_leader_drafts_and_tokens_match(ray_cluster, backend, reference):
    """One slice over two host actors: the leader drafts from its replica and the follower
    verifies the same drafts (they agree on every step's tokens, or the slice is lost)."""
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=1, tp=2, engine_config=SPEC_ENGINE,
                               backend=dataclasses.replace(backend, hosts_per_slice=2),
                               spec_budget=always_on())
    try:
        out = _ray_rollout(group, "seer")
        _assert_complete_and_greedy(out, reference)
        assert out.report.spec_accepted > 0 and not out.report.lost_instances
        follower = ray_cluster.get(group.instances[0].actors[1].snapshot.remote())
        assert follower.draft is None  # no replica on the follower: it takes the leader's drafts
    finally:
        group.shutdown()


def test_engine_actor_lost_while_holding_replicas_loses_nothing(actors, reference):
    """Last in the module: it leaves the shared group with one actor. The killed actor's
    requests re-run on the other one, drafting from the service."""
    out = _ray_rollout(actors, "seer", fault=FaultPlan(instance=1, after_chunks=6))
    _assert_complete_and_greedy(out, reference)
    assert out.report.lost_instances == [1] and out.report.redispatched_chunks > 0
    assert out.report.spec_accepted > 0
    assert out.report.draft_service["lost_shards"] == 0
