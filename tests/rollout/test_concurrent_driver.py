"""The concurrent wall-clock driver on in-process mesh slices (threads): every instance steps at
once, decisions do not depend on timing, faults are re-dispatched without changing the output."""

from __future__ import annotations

import jax
import pytest

from seer_jax.errors import ConfigError
from seer_jax.model.generate import generate
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.config import default_config, validate_config
from seer_jax.rollout.core.concurrent_driver import FaultPlan
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams
from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS  # noqa: E402

pytestmark = pytest.mark.slow  # engines or a cluster: make test runs these, test-fast does not



@pytest.fixture(scope="module")
def reference():
    return generate(PARAMS, CFG, GROUPS, 30)


def _run(policy, fault=None, clock="concurrent", replacer=None):
    pool = HostKVPool()
    insts = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                                  pool=pool, devices=jax.devices()[:2])
    return rollout(GROUPS, group_size=3, max_tokens=30, instances=insts,
                   sampling=SamplingParams(temperature=0.0), policy=policy, pool=pool,
                   config={"chunk_size": 8}, clock=clock, fault=fault, replacer=replacer)


@pytest.mark.parametrize("policy", ["seer", "request_fcfs", "group_round_robin"])
def test_concurrent_driver_greedy_identical_and_deterministic(policy, reference):
    a, b = _run(policy), _run(policy)
    for r in a.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    # the controller sees the same events in the same order whatever the threads' timing
    assert [r.instances for r in a.results] == [r.instances for r in b.results]
    assert all(i.steps > 0 for i in a.report.instances)
    if policy != "group_round_robin":
        assert a.report.chunks > 12


def test_fault_plan_redispatches_every_lost_chunk_once(reference):
    out = _run("seer", fault=FaultPlan(instance=1, after_chunks=6))
    assert out.report.lost_instances == [1]
    assert out.report.redispatched_chunks > 0
    assert out.report.summary()["redispatched_chunks"] == out.report.redispatched_chunks
    assert sorted(r.request_id for r in out.results) == sorted(
        f"g{g}/{j}" for g in range(4) for j in range(3))
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    # nothing ran on the lost instance after it was lost
    lost_at = out.report.instances[1].lost_at
    assert lost_at is not None and out.report.instances[1].last_busy_at <= lost_at


def test_fault_plan_needs_the_concurrent_clock_and_a_real_instance():
    with pytest.raises(ConfigError, match=r"clock='wall' with fault injection is invalid"):
        _run("seer", fault=FaultPlan(1, 2), clock="wall")
    with pytest.raises(ConfigError, match=r"fault_kill_instance=5 is invalid; allowed: -1 \(off\) or 0..1"):
        _run("seer", fault=FaultPlan(5, 2))
    with pytest.raises(ConfigError, match=r"fault_when='soon' is invalid; allowed: \['chunks', 'kv_put'"):
        _run("seer", fault=FaultPlan(1, 2, when="soon"))
    # an in-process instance has no process to exit mid-load
    with pytest.raises(ConfigError, match=r"fault_when='kv_load' is invalid for in-process"):
        _run("seer", fault=FaultPlan(1, 2, when="kv_load"))
    with pytest.raises(ConfigError, match=r"clock='wall' with replacement of lost instances"):
        _run("seer", clock="wall", replacer=object())


@pytest.mark.parametrize("key, value, msg", [
    ("backend", "mpi", r"config.backend='mpi' is invalid: allowed: inprocess, ray"),
    ("clock", "fast", r"config.clock='fast' is invalid: allowed: emulated, wall, concurrent"),
    ("fault_kill_instance", 2, r"config.fault_kill_instance=2 is invalid: allowed: -1 \(off\) or 0..1"),
    ("fault_after_chunks", -1, r"config.fault_after_chunks=-1 is invalid"),
    ("ray_resource", "NPU", r"config.ray_resource='NPU' is invalid; allowed: \['CPU', 'GPU', 'TPU'\]"),
    ("ray_hosts_per_slice", 0, r"config.ray_hosts_per_slice=0 is invalid; allowed: an integer >= 1"),
    ("ray_hosts_per_slice", 2, r"config.ray_hosts_per_slice=2 is invalid for tp=1; allowed: a divisor of tp"),
    ("ray_pipeline_depth", 0, r"config.ray_pipeline_depth=0 is invalid; allowed: an integer from 1 to 8"),
    ("ray_step_timeout_s", 0.0, r"config.ray_step_timeout_s=0.0 is invalid; allowed: a number > 0"),
    ("ray_step_timeout_factor", 0.5,
     r"config.ray_step_timeout_factor=0.5 is invalid; allowed: a number >= 1"),
    ("ray_liveness_timeout_s", -1.0, r"config.ray_liveness_timeout_s=-1.0 is invalid; allowed: a number > 0"),
    ("ray_startup_timeout_s", 0.0, r"config.ray_startup_timeout_s=0.0 is invalid; allowed: a number > 0"),
    ("fault_when", "later", r"config.fault_when='later' is invalid: allowed: chunks, kv_put, kv_load"),
    ("kv_pool", "ray", r"config.kv_pool='ray' is invalid: allowed with backend='inprocess': "
                       r"host, mooncake \(or '' for host\)"),
    ("ray_kv_pool", "host", r"config.kv_pool='host' is invalid: allowed with backend='ray': ray, "
                            r"mooncake"),
])
def test_backend_config_errors_name_key_value_allowed(key, value, msg):
    c = default_config()
    c.backend = "ray" if key.startswith("ray_") else c.backend
    c[key.replace("ray_kv_pool", "kv_pool")] = value
    with pytest.raises(ConfigError, match=msg):
        validate_config(c)


def test_fault_injection_config_needs_concurrent_clock():
    c = default_config()
    c.fault_kill_instance = 1
    with pytest.raises(ConfigError, match=r"config.clock='emulated' is invalid: allowed: concurrent"):
        validate_config(c)
    c.clock = "concurrent"
    assert validate_config(c) == ["seer"]


def test_replacing_lost_actors_needs_ray_and_the_concurrent_clock():
    c = default_config()
    c.ray_replace_lost = True
    with pytest.raises(ConfigError, match=r"config.ray_replace_lost=True is invalid: allowed: False "
                                          r"unless backend='ray'"):
        validate_config(c)
    c.backend = "ray"
    with pytest.raises(ConfigError, match=r"config.clock='emulated' is invalid: allowed: concurrent "
                                          r"when ray_replace_lost is set"):
        validate_config(c)
    c.clock = "concurrent"
    assert validate_config(c) == ["seer"]
    # a lost slice spanning several hosts is not replaced
    c.tp, c.ray_hosts_per_slice = 2, 2
    with pytest.raises(ConfigError, match=r"config.ray_replace_lost=True is invalid: allowed: False "
                                          r"with ray_hosts_per_slice=2 .*or set ray_hosts_per_slice=1"):
        validate_config(c)
    c.tp, c.ray_hosts_per_slice = 1, 1
    c.backend, c.ray_replace_lost = "inprocess", False
    c.fault_kill_instance, c.fault_when = 1, "kv_load"
    with pytest.raises(ConfigError, match=r"config.fault_when='kv_load' is invalid: allowed: "
                                          r"chunks, kv_put unless backend='ray'"):
        validate_config(c)


class _SpareReplacer:
    """Replaces a lost instance with a spare in-process engine, which comes up (answers a
    non-blocking poll) only on the third poll, so the rollout goes on without it meanwhile."""

    def __init__(self, spare):
        self.spare, self.polls, self.started = spare, 0, []

    def replace(self, lost_id):
        self.started.append(lost_id)

    def pending_replacements(self):
        return len(self.started)

    def joined(self, next_id, wait):
        self.polls += 1
        if not self.started or (self.polls < 3 and not wait):
            return []
        self.spare.instance_id = next_id
        return [(self.started.pop(), self.spare)]


def test_a_replacement_joins_while_the_rollout_goes_on(reference):
    pool = HostKVPool()
    insts = make_engine_instances(CFG, PARAMS, num_instances=3, tp=1, engine_config=ENGINE,
                                  pool=pool, devices=jax.devices()[:3])
    replacer = _SpareReplacer(insts[2])
    out = rollout(GROUPS, group_size=3, max_tokens=30, instances=insts[:2],
                  sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                  config={"chunk_size": 8}, clock="concurrent",
                  fault=FaultPlan(instance=1, after_chunks=4), replacer=replacer)
    assert sorted(r.request_id for r in out.results) == sorted(
        f"g{g}/{j}" for g in range(4) for j in range(3))
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    rep = out.report
    assert rep.lost_instances == [1] and rep.replacement_instances == [2]
    assert replacer.polls >= 3 and rep.instances[2].chunks > 0
    assert rep.num_instances == 3 and rep.chunks == sum(i.chunks for i in rep.instances)


class _QueuedInstance:
    """An in-process engine behind an actor-like call queue: `submit`, `set_now` and steps run in
    the order they were sent, and only when the driver collects a step, as a Ray actor's calls do
    (the fake runs them lazily, the actor as soon as it can; the order is the same)."""

    def __init__(self, inner, depth):
        self.inner, self.pipeline_depth = inner, depth
        self.instance_id = inner.instance_id
        self.calls: list = []  # ("submit", chunk) / ("set_now", t) / ("step", token)
        self.started = 0
        self.max_queued_steps = 0  # most steps sent and not yet collected
        self.step_reports: list = []

    def __getattr__(self, name):  # load, resident_tokens, running_progress, abort
        return getattr(self.inner, name)

    def now(self):
        return self.inner.now()

    def set_now(self, t):
        self.calls.append(("set_now", t))

    def submit(self, chunk):
        self.calls.append(("submit", chunk))

    def has_work(self):
        return self.inner.has_work() or any(kind == "submit" for kind, _ in self.calls)

    def start_step(self):
        self.started += 1
        self.calls.append(("step", self.started))
        self.max_queued_steps = max(self.max_queued_steps,
                                    sum(kind == "step" for kind, _ in self.calls))
        return self.started

    def finish_step(self, token):
        while True:
            kind, arg = self.calls.pop(0)
            if kind == "step":
                assert arg == token, "steps must be collected in the order they were started"
                rep = self.inner.step()
                self.step_reports.append(rep)
                return rep
            getattr(self.inner, kind)(arg)

    def step(self):
        return self.finish_step(self.start_step())


def _run_queued(depth, fault=None):
    pool = HostKVPool()
    insts = [_QueuedInstance(i, depth) for i in make_engine_instances(
        CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE, pool=pool,
        devices=jax.devices()[:2])]
    out = rollout(GROUPS, group_size=3, max_tokens=30, instances=insts,
                  sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                  config={"chunk_size": 8}, clock="concurrent", fault=fault)
    return out, insts


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_pipelined_steps_keep_tokens_and_decisions_fixed(depth, reference):
    a, insts = _run_queued(depth)
    b, _ = _run_queued(depth)
    assert sorted(r.request_id for r in a.results) == sorted(
        f"g{g}/{j}" for g in range(4) for j in range(3))
    for r in a.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    # what the controller decided depends only on the order of the driver's calls
    assert [r.instances for r in a.results] == [r.instances for r in b.results]
    for inst in insts:
        # the driver kept `depth` steps queued, and collected every step it sent
        assert inst.max_queued_steps == depth
        assert not inst.calls and not inst.inner.has_work()
    # the steps queued past the last chunk found nothing to do
    assert sum(len(rep.finished) for i in insts for rep in i.step_reports) == a.report.chunks


def test_pipelined_steps_start_dispatched_chunks_later():
    """With a step already queued, a chunk dispatched in a round starts one step later: the
    rollout takes more steps in all than at depth 1 (the schedule differs, the tokens do not)."""
    one, _ = _run_queued(1)
    two, insts = _run_queued(2)
    assert [r.token_ids for r in one.results] == [r.token_ids for r in two.results]
    steps = [sum(1 for rep in i.step_reports if rep.batch_size) for i in insts]
    assert sum(steps) > sum(i.steps for i in one.report.instances)


def test_pipelined_fault_redispatches_every_lost_chunk_once(reference):
    out, insts = _run_queued(2, fault=FaultPlan(instance=1, after_chunks=6))
    assert out.report.lost_instances == [1] and out.report.redispatched_chunks > 0
    assert sorted(r.request_id for r in out.results) == sorted(
        f"g{g}/{j}" for g in range(4) for j in range(3))
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
