"""Mesh slices as Ray actors on one local loopback cluster (module-scoped): greedy tokens equal
the in-process run, migrated KV moves through the object store, weight sync, faults (killed
and hung actors) re-dispatched without losing or duplicating a response, slow steps that are
not losses, errors inside an actor that fail the rollout, and a failed run that leaves nothing
behind."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

import jax
import pytest

from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.generate import generate
from seer_jax.model.llama import init_params
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig, require_ray
from seer_jax.rollout.core.concurrent_driver import FaultPlan
from seer_jax.rollout.core.instance import InstanceFailedError, InstanceLostError
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import ChunkRequest, SamplingParams
from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS  # noqa: E402
from tests.subprocess_env import compilation_cache_env

# a Ray cluster and engines: make test runs these (on the worker that holds the cluster),
# test-fast does not
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

REQUEST_IDS = sorted(f"g{g}/{j}" for g in range(4) for j in range(3))
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def backend():
    # the actors load the executables that this run's other processes compiled (the test
    # session's persistent compilation cache, tests/conftest.py), and later actors those of
    # the first ones
    return RayBackendConfig(step_timeout_s=120.0, env=compilation_cache_env())


@pytest.fixture(scope="module")
def actors(ray_cluster, backend):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    # each actor pinned to its own core (bundle k -> core k mod cpus)
    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=dataclasses.replace(backend, pin_cpus=True))
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


def test_pinned_actors_run_on_their_own_core(actors):

    cpus = os.cpu_count()
    for k, inst in enumerate(actors.instances):
        assert os.sched_getaffinity(inst.snap.pid) == {k % cpus}
    with pytest.raises(ConfigError, match="pin_cpus=True is invalid with resource='GPU'"):
        RayBackendConfig(resource="GPU", pin_cpus=True).validate()
    env = RayBackendConfig(pin_cpus=True).actor_env(1, bundle_index=cpus + 1)
    assert env["SEER_JAX_ACTOR_CPU_CORE"] == str(1 % cpus)
    assert "SEER_JAX_ACTOR_CPU_CORE" not in RayBackendConfig().actor_env(1, bundle_index=1)


@pytest.mark.parametrize("policy", ["seer", pytest.param("request_fcfs", marks=pytest.mark.exhaustive),
                                    pytest.param("group_round_robin", marks=pytest.mark.exhaustive)])
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
    from seer_jax.rollout.backends.ray_pool import RayKVPool

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


def test_a_step_slower_than_the_fixed_timeout_is_not_a_loss(ray_cluster, actors, reference):
    """A step sleeps (test hook) three times past step_timeout_s: the actor answers pings
    meanwhile and its limit grew with its measured steps, so it is not lost."""
    inst = actors.instances[0]
    saved = inst.step_timeout_s, inst.liveness_interval_s
    try:
        inst.liveness_interval_s = 0.2
        inst.actor.inject_fault.remote("slow", 1.0)  # one measured step of at least 1 s
        _assert_complete_and_greedy(_ray_rollout(actors, "seer"), reference)
        live = ray_cluster.get(inst.actor.ping.remote())
        assert live.longest_step_s >= 1.0 and live.running_s is None and live.steps > 0
        inst.step_timeout_s = 1.0  # a fixed timeout of 1 s would lose the next step
        assert inst.step_limit(live.longest_step_s) >= 10.0
        inst.actor.inject_fault.remote("slow", 3.0)
        out = _ray_rollout(actors, "seer")
        _assert_complete_and_greedy(out, reference)
        assert out.report.lost_instances == [] and actors.lost == []
        assert ray_cluster.get(inst.actor.ping.remote()).longest_step_s >= 3.0
    finally:
        inst.step_timeout_s, inst.liveness_interval_s = saved


def test_an_error_inside_an_actor_fails_the_rollout_with_its_traceback(actors):
    """Engine code raising inside an actor is a bug, not a lost machine: the rollout fails with
    the error and the actor's traceback, and no instance is lost."""
    inst = actors.instances[1]
    inst.actor.inject_fault.remote("raise")
    try:
        with pytest.raises(InstanceFailedError,
                           match=r"(?s)instance 1 raised SeerError: injected fault on instance 1"
                                 r".*traceback in the actor.*ray_actor\.py"):
            _ray_rollout(actors, "seer")
        assert actors.lost == [] and not inst.killed
        inst.check_alive()
    finally:
        inst.actor.inject_fault.remote(None)


def test_killed_actor_requests_are_redispatched_exactly_once(ray_cluster, backend, reference):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

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


def test_hung_actor_is_lost_and_a_group_with_fewer_slices_refuses_to_go_on(
        ray_cluster, backend, reference, caplog):
    """A step that never returns while its actor answers liveness pings is lost once it runs
    past its limit, and its chunks rerun; the next rollout refuses to start on fewer slices than
    configured unless allowed, and then its report and the log say so."""
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=3, tp=1, engine_config=ENGINE,
                               backend=backend)
    try:
        hung = group.instances[2]
        hung.actor.inject_fault.remote("hang")
        hung.step_timeout_s, hung.step_timeout_factor, hung.liveness_interval_s = 2.0, 1.0, 0.2
        with caplog.at_level(logging.WARNING):
            out = _ray_rollout(group, "seer")
        _assert_complete_and_greedy(out, reference)
        assert out.report.lost_instances == [2] and out.report.redispatched_chunks >= 1
        # it answered pings in the middle of the step (a silent actor's reason differs)
        assert "instance 2 lost: step running for" in caplog.text
        with pytest.raises(SeerError, match="instance 2 lost"):
            hung.check_alive(timeout_s=5.0)
        with pytest.raises(SeerError, match=r"2 of the 3 configured Ray slices are live .*"
                                            r"allowed: allow_fewer_slices=True"):
            group.reset()
        group.allow_fewer_slices = True
        group.reset()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            out = rollout(GROUPS, group_size=3, max_tokens=30, instances=group.instances,
                          sampling=GREEDY, policy="seer", pool=group.pool,
                          config={"chunk_size": 8}, clock="concurrent",
                          configured_instances=group.num_slices)
        _assert_complete_and_greedy(out, reference)
        assert out.report.num_instances == 2 and out.report.configured_instances == 3
        assert out.report.summary()["configured_instances"] == 3
        assert "starts on 2 of 3 configured instances" in caplog.text
    finally:
        group.shutdown()


def test_two_host_slice_matches_inprocess_tp2(ray_cluster, backend, reference):
    """One slice over two host actors (one CPU device each, tp=2 under jax.distributed): the
    same greedy tokens as tp=2 in this process after a weight sync; chunks continue through the
    KV pool; reset reaches both hosts; a follower that dies loses the whole slice and the KV its
    leader wrote."""
    from seer_jax.rollout.backends.ray_group import make_ray_instances

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
        # reset reaches both hosts: fresh engines, clock 0
        assert min(ray_cluster.get(a.snapshot.remote()).now for a in inst.actors) > 0
        group.reset()
        assert [ray_cluster.get(a.snapshot.remote()).now for a in inst.actors] == [0.0, 0.0]
        # a lost slice drops the KV blobs of its leader, their only writer
        told = []
        pool = inst.pool
        inst.pool = type("Pool", (), {"writer_lost": lambda self, w: told.append(w)})()
        ray_cluster.kill(inst.actors[1], no_restart=True)
        # ray.kill is asynchronous: a call sent right after it may still be answered
        deadline = time.monotonic() + 120.0
        with pytest.raises(InstanceLostError, match="instance 0 lost"):
            while time.monotonic() < deadline:
                inst.check_alive(timeout_s=10.0)
                time.sleep(0.05)
        inst.pool = pool
        assert group.lost == [0] and told == [inst.actors[0]._actor_id.hex()]
    finally:
        group.shutdown()


def test_writer_killed_after_its_kv_put_the_blob_is_lost_and_reprefilled(ray_cluster, backend,
                                                                          reference):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=backend)
    try:
        out = _ray_rollout(group, "seer", fault=FaultPlan(instance=1, after_chunks=2, when="kv_put"))
        _assert_complete_and_greedy(out, reference)
        assert out.report.lost_instances == [1] and out.report.redispatched_chunks >= 1
        st = group.pool.stats()
        # the blobs instance 1 put were owned by its process: dropped as lost when it was found
        # dead, before anything read them; the requests that read one then re-prefilled
        assert st.lost >= 1 and out.report.kv_pool_lost_blobs == st.lost
        assert 0 < out.report.reprefill_chunks == st.misses <= st.lost
        assert out.report.reprefill_tokens > 0
        assert st.bytes_got == out.report.kv_bytes_imported
        assert out.report.summary()["reprefill_chunks"] == out.report.reprefill_chunks
    finally:
        group.shutdown()


class _JoinBeforeDispatch:
    """The group as replacer, but the driver waits for each replacement before it dispatches
    again, so the replacement still has chunks to serve in this short rollout."""

    def __init__(self, group):
        self.group = group

    def replace(self, lost_id):
        self.group.replace(lost_id)

    def pending_replacements(self):
        return self.group.pending_replacements()

    def joined(self, next_id, wait):
        return self.group.joined(next_id, wait=True)


def test_reader_killed_while_importing_kv_is_replaced_with_the_current_weights(ray_cluster,
                                                                               backend):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    new = init_params(CFG, seed=12)
    expect = generate(new, CFG, GROUPS, 30)
    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=backend, replace_lost=True)
    try:
        group.update_params(new, version=5)
        # instance 1 dies while importing a request's KV that instance 0 wrote
        out = rollout(GROUPS, group_size=3, max_tokens=30, instances=group.instances,
                      sampling=GREEDY, policy="seer", pool=group.pool, config={"chunk_size": 8},
                      clock="concurrent", replacer=_JoinBeforeDispatch(group),
                      fault=FaultPlan(instance=1, after_chunks=2, when="kv_load"))
        assert sorted(r.request_id for r in out.results) == REQUEST_IDS
        for r in out.results:  # the replacement generates with the synced weights
            assert r.token_ids == expect[r.group_index].token_ids, r.request_id
        rep = out.report
        assert rep.lost_instances == [1] and rep.redispatched_chunks >= 1
        st = group.pool.stats()
        # the dying reader fetched a blob that never reached an engine ...
        assert st.bytes_got > rep.kv_bytes_imported
        # ... and it stayed in the pool: the re-dispatched chunk read it (its writer, instance
        # 0, is alive); the only re-prefills are of blobs instance 1 wrote itself
        assert rep.reprefill_chunks == st.misses <= st.lost
        # a replacement joined in the lost actor's bundle and served chunks
        assert rep.replacement_instances == [2] and rep.summary()["replacement_instances"] == 1
        assert rep.instances[2].chunks > 0 and any(2 in r.instances for r in out.results)
        new_inst = group.instances[2]
        assert new_inst.bundle_index == 1 and new_inst.snap.params_version == 5
        assert new_inst.snap.pid != group.instances[1].snap.pid
        # the next rollout runs on the live actors, numbered 0..1 again
        out2 = _ray_rollout(group, "request_fcfs")
        assert [i.instance_id for i in group.instances] == [0, 1] and group.lost == []
        assert [r.token_ids for r in out2.results] == [r.token_ids for r in out.results]
        assert all(i.chunks > 0 for i in out2.report.instances)
    finally:
        group.shutdown()


@pytest.mark.parametrize("kill", [pytest.param(False, marks=pytest.mark.exhaustive), True])
def test_actors_share_a_mooncake_store_pool(ray_cluster, backend, reference, kill):
    """KV moves between the actors through the store; with `kill`, the reader of a blob dies in
    the middle of the transfer (after fetching it, before installing it) and its chunk runs on
    the other actor from the same blob."""
    from seer_jax.rollout.backends.mooncake_pool import MooncakeKVPool
    from seer_jax.rollout.backends.ray_group import make_ray_instances
    from tests.rollout.mooncake_util import loopback_master_or_skip

    with loopback_master_or_skip() as master:
        group = make_ray_instances(
            CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE, backend=backend,
            pool_factory=lambda cap: MooncakeKVPool.create(master.config, cap, shared=True))
        try:
            fault = FaultPlan(instance=1, after_chunks=2, when="kv_load") if kill else None
            out = _ray_rollout(group, "seer", fault=fault)
            _assert_complete_and_greedy(out, reference)
            st = group.pool.stats()
            assert isinstance(group.pool, MooncakeKVPool) and out.report.migrations > 0
            if kill:
                assert out.report.lost_instances == [1] and out.report.redispatched_chunks >= 1
                # the dying reader fetched a blob that never reached its engine
                assert st.bytes_got > out.report.kv_bytes_imported
                return
            # KV moved between the actors' processes through the store, not by re-prefill
            assert out.report.reprefill_tokens == 0
            assert st.bytes_got == out.report.kv_bytes_imported > 0
            assert out.report.kv_pool_transfer_gbps > 0 and st.entries == 0
        finally:
            group.shutdown()


def test_replacing_lost_multi_host_slices_is_refused():
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    with pytest.raises(ConfigError, match=r"replace_lost=True is invalid with hosts_per_slice=2; "
                                          r"allowed: replace_lost=False .* or hosts_per_slice=1"):
        make_ray_instances(CFG, PARAMS, num_instances=1, tp=2, engine_config=ENGINE,
                           backend=RayBackendConfig(hosts_per_slice=2), replace_lost=True)


class _RecordingPool:
    """A KV pool backend recording what one host's `_HostPool` asks of it."""

    def __init__(self):
        self.fetched, self.put_ids = [], []

    def fetch(self, handle, refs, report=True):
        self.fetched.append((handle, refs, report))
        return f"blob of {handle}"

    def put(self, request_id, blob, nbytes):
        self.put_ids.append(request_id)
        return f"{request_id}@1"


def test_host_pool_imports_what_the_proxy_resolved_and_only_the_leader_writes():
    """Each host of a multi-host slice reads the blob the proxy resolved (any backend's
    `fetch`), once; the leader alone reports reads and writes (the kv_load fault hook reads
    through the same `get`)."""
    from seer_jax.rollout.backends.ray_actor import _HostPool

    for leader in (True, False):
        base = _RecordingPool()
        pool = _HostPool(base, leader=leader)
        pool.resolve("r@1", ["ref"])
        pool.resolve("gone@1", [])
        assert pool.get("r@1") == "blob of r@1" and pool.get("r@1") is None  # consumed
        assert pool.get("gone@1") is None and pool.get("never@1") is None
        assert base.fetched == [("r@1", ["ref"], leader)]
        assert pool.put("r", object(), 8) == ("r@1" if leader else "")
        assert base.put_ids == (["r"] if leader else [])


class _Tokenizer:
    """Enough of a tokenizer for `run_rollout` on the tiny model."""

    eos_id = 7

    def encode(self, text):
        return [8 + ord(ch) % 200 for ch in text[:12]]

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_a_failed_run_rollout_leaves_no_actor_pool_or_placement_group(ray_cluster, monkeypatch):
    """run_rollout releases the Ray actors, the KV pool's directory actor and the placement
    group when the rollout raises."""
    import seer_jax.model
    import seer_jax.rollout.backends.ray_group as ray_group
    import seer_jax.rollout.core.run as core_run
    from seer_jax.rollout.api import run_rollout
    from seer_jax.rollout.config import default_config

    started = []
    make = ray_group.make_ray_instances

    def make_tiny(cfg, weights, **kw):
        started.append(make(CFG, PARAMS, **kw))
        return started[-1]

    def boom(*args, **kwargs):
        raise RuntimeError("boom in the middle of the rollout")

    monkeypatch.setattr(seer_jax.model, "load", lambda name, dtype: (CFG, PARAMS, _Tokenizer()))
    monkeypatch.setattr(ray_group, "make_ray_instances", make_tiny)
    monkeypatch.setattr(core_run, "rollout", boom)
    c = default_config()
    c.update(dict(backend="ray", clock="concurrent", num_instances=2, chat=False, num_prompts=2,
                  group_size=2, max_tokens=8, ray_step_timeout_s=120.0))
    c.engine.update(dict(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                         max_prefill_seqs=2))
    with pytest.raises(RuntimeError, match="boom in the middle"):
        run_rollout(c)
    (group,) = started
    for actor in [a for inst in group.instances for a in inst.actors] + [group.pool.directory]:
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            ray_cluster.get(actor.__ray_ready__.remote(), timeout=60)
    table = ray_cluster.util.placement_group_table(group.placement_group)
    assert table["state"] == "REMOVED"


def test_actors_that_do_not_start_in_time_fail_with_an_error_naming_the_timeout(ray_cluster,
                                                                                 backend):
    """No process imports jax and builds an engine in a millisecond."""
    from seer_jax.rollout.backends.ray_group import ActorStartupError, make_ray_instances

    with pytest.raises(ActorStartupError, match=r"not all actors started within ray "
                                                r"startup_timeout_s=0.001 s"):
        make_ray_instances(CFG, PARAMS, num_instances=1, tp=1, engine_config=ENGINE,
                           backend=dataclasses.replace(backend, startup_timeout_s=0.001))
