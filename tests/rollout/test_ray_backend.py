"""Mesh slices as Ray actors on one local loopback cluster (module-scoped): greedy tokens equal
the in-process run, migrated KV moves through the object store, weight sync, and faults (killed,
raising and hung actors) re-dispatched without losing or duplicating a response."""

from __future__ import annotations

import dataclasses
import sys

import jax
import pytest

from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.generate import generate
from seer_jax.model.llama import init_params
from seer_jax.rollout.concurrent_driver import FaultPlan
from seer_jax.rollout.engine_instance import make_engine_instances
from seer_jax.rollout.instance import InstanceLostError
from seer_jax.rollout.kv_pool import HostKVPool
from seer_jax.rollout.ray_cluster import RayBackendConfig, require_ray
from seer_jax.rollout.run import rollout
from seer_jax.rollout.types import ChunkRequest, SamplingParams
from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS  # noqa: E402

pytestmark = pytest.mark.slow  # engines or a cluster: make test runs these, test-fast does not

REQUEST_IDS = sorted(f"g{g}/{j}" for g in range(4) for j in range(3))
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'seer-jax[ray]')")
    from seer_jax.rollout.ray_cluster import ensure_ray

    ensure_ray(RayBackendConfig(object_store_mb=200, num_cpus=8))
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # actors started later in the module load the executables the first ones compiled
    cache = str(tmp_path_factory.mktemp("jax_cache"))
    return RayBackendConfig(step_timeout_s=120.0, env={
        "JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})


@pytest.fixture(scope="module")
def actors(ray_cluster, backend):
    from seer_jax.rollout.ray_instance import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=backend)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def reference():
    return generate(PARAMS, CFG, GROUPS, 30)


def _ray_rollout(group, policy, fault=None):
    group.reset()
    return rollout(GROUPS, group_size=3, max_tokens=30, instances=group.instances,
                   sampling=GREEDY, policy=policy, pool=group.pool, config={"chunk_size": 8},
                   clock="concurrent", fault=fault)


def _inprocess_rollout(policy):
    pool = HostKVPool()
    insts = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                                  pool=pool, devices=jax.devices()[:2])
    return rollout(GROUPS, group_size=3, max_tokens=30, instances=insts, sampling=GREEDY,
                   policy=policy, pool=pool, config={"chunk_size": 8}, clock="concurrent")


def _assert_complete_and_greedy(out, reference):
    assert sorted(r.request_id for r in out.results) == REQUEST_IDS  # each exactly once
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id


def test_missing_ray_is_a_config_error_saying_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'seer-jax\[ray\]'"):
        require_ray()


@pytest.mark.parametrize("policy", ["seer", "request_fcfs", "group_round_robin"])
def test_greedy_tokens_identical_to_inprocess(actors, reference, policy):
    out = _ray_rollout(actors, policy)
    _assert_complete_and_greedy(out, reference)
    local = _inprocess_rollout(policy)
    assert [r.token_ids for r in out.results] == [r.token_ids for r in local.results]
    # same decisions as the in-process run: the controller does not see where a slice lives
    assert [r.instances for r in out.results] == [r.instances for r in local.results]
    assert len({i for r in out.results for i in r.instances}) == 2
    # the actors really ran on other processes
    assert len({inst.snap.pid for inst in actors.instances}) == 2


def test_migrated_kv_moves_through_the_object_store(actors, reference):
    out = _ray_rollout(actors, "seer")
    _assert_complete_and_greedy(out, reference)
    st = actors.pool.stats()
    assert out.report.migrations > 0
    # every chunk that continued elsewhere imported its KV from the store, not by re-prefill
    assert out.report.reprefill_tokens == 0
    assert st.bytes_got == out.report.kv_bytes_imported > 0
    assert st.bytes_put == out.report.kv_bytes_exported > 0
    assert out.report.kv_pool_bytes_moved == st.bytes_moved
    assert out.report.kv_pool_transfer_gbps is not None and out.report.kv_pool_transfer_gbps > 0
    assert st.entries == 0  # finished requests' KV was dropped


def test_pool_capacity_evicts_and_the_request_reprefills(ray_cluster, actors, reference):
    from seer_jax.rollout.ray_pool import RayKVPool

    actors.pool_capacity_bytes = 1  # smaller than any blob: nothing stays in the pool
    try:
        out = _ray_rollout(actors, "seer")
    finally:
        actors.pool_capacity_bytes = None
    _assert_complete_and_greedy(out, reference)
    st = actors.pool.stats()
    assert st.evictions == st.puts > 0 and st.bytes_got == 0 and st.entries == 0
    assert out.report.reprefill_tokens > 0
    assert isinstance(actors.pool, RayKVPool)


def test_weight_sync_changes_the_next_rollout_to_the_new_weights(actors, reference):
    new = init_params(CFG, seed=12)
    expect = generate(new, CFG, GROUPS, 30)
    assert [g.token_ids for g in expect] != [g.token_ids for g in reference]
    try:
        assert actors.update_params(new) == 1
        assert [i.snap.params_version for i in actors.instances] == [1, 1]
        out = _ray_rollout(actors, "seer")
        for r in out.results:
            assert r.token_ids == expect[r.group_index].token_ids, r.request_id
        # a sync while a chunk is in flight is refused: no response mixes two versions
        inst = actors.instances[0]
        inst.submit(ChunkRequest(request_id="x", group_id="gx", prompt_ids=(9, 10, 11),
                                 output_ids=(), max_new_tokens=4, original_max_tokens=4,
                                 sampling=GREEDY))
        with pytest.raises(SeerError, match=r"chunks in flight on instances \[0\]"):
            actors.update_params(PARAMS, version=7)
    finally:
        actors.reset()
        actors.update_params(PARAMS, version=2)
    assert [i.snap.params_version for i in actors.instances] == [2, 2]


def test_killed_actor_requests_are_redispatched_exactly_once(ray_cluster, backend, reference):
    from seer_jax.rollout.ray_instance import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=backend)
    try:
        pid = group.instances[1].snap.pid
        out = _ray_rollout(group, "seer", fault=FaultPlan(instance=1, after_chunks=6))
        _assert_complete_and_greedy(out, reference)
        assert out.report.lost_instances == [1] and group.lost == [1]
        assert out.report.redispatched_chunks > 0
        assert all(r.instances[-1] == 0 for r in out.results)
        # the killed process is gone (its parent may take a moment to reap it under load)
        import os
        import time

        deadline = time.monotonic() + 20.0
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the killed actor's process {pid} is still alive after 20 s")
            time.sleep(0.1)
    finally:
        group.shutdown()


def test_raising_and_hung_actors_are_lost_and_their_chunks_rerun(ray_cluster, backend, reference):
    from seer_jax.rollout.ray_instance import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=3, tp=1, engine_config=ENGINE,
                               backend=backend)
    try:
        group.instances[1].actor.inject_fault.remote("raise")
        group.instances[2].actor.inject_fault.remote("hang")
        group.instances[2].step_timeout_s = 2.0
        out = _ray_rollout(group, "seer")
        _assert_complete_and_greedy(out, reference)
        assert sorted(out.report.lost_instances) == [1, 2]
        assert out.report.redispatched_chunks >= 2
        with pytest.raises(SeerError, match="instance 2 lost"):
            group.instances[2].check_alive(timeout_s=5.0)
    finally:
        group.shutdown()


def test_two_host_slice_matches_inprocess_tp2(ray_cluster, backend, reference):
    """One slice over two host actors (one CPU device each, tp=2 under jax.distributed): the
    same greedy tokens as tp=2 in this process after a weight sync; chunks continue through the
    KV pool; a follower that dies loses the whole slice."""
    from seer_jax.rollout.ray_instance import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=1, tp=2, engine_config=ENGINE,
                               backend=dataclasses.replace(backend, hosts_per_slice=2))
    try:
        inst = group.instances[0]
        follower = ray_cluster.get(inst.actors[1].snapshot.remote())
        assert len(inst.actors) == 2 and follower.pid != inst.snap.pid
        # new weights reach both hosts (re-sharded over the two-process mesh)
        assert group.update_params(PARAMS) == 1
        assert [ray_cluster.get(a.snapshot.remote()).params_version for a in inst.actors] == [1, 1]
        out = _ray_rollout(group, "seer")
        _assert_complete_and_greedy(out, reference)
        pool = HostKVPool()
        local = rollout(GROUPS, group_size=3, max_tokens=30, sampling=GREEDY, policy="seer",
                        instances=make_engine_instances(CFG, PARAMS, num_instances=1, tp=2,
                                                        engine_config=ENGINE, pool=pool,
                                                        devices=jax.devices()[:2]),
                        pool=pool, config={"chunk_size": 8}, clock="concurrent")
        assert [r.token_ids for r in out.results] == [r.token_ids for r in local.results]
        # chunks ended and continued from the KV the leader wrote, imported by both hosts
        assert out.report.kv_bytes_imported > 0 and out.report.reprefill_tokens == 0
        assert group.pool.stats().puts == out.report.chunks - len(out.results)
        ray_cluster.kill(inst.actors[1], no_restart=True)
        with pytest.raises(InstanceLostError, match="instance 0 lost"):
            inst.check_alive(timeout_s=10.0)
        assert group.lost == [0]
    finally:
        group.shutdown()
