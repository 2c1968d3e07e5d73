"""Mesh slices as Ray actors: `RayInstance` (the controller's `Instance`) and `RayInstanceGroup`.

One actor per slice (`EngineActor`) owns an `EngineInstance` on the devices its process sees (on a
dev box: `tp` fake CPU devices set through the actor's environment before jax is imported). The
actors are placed with a placement group, one bundle per slice host (`RayBackendConfig`).
What reaches an actor is plain data: the `ModelConfig` and `EngineConfig` dataclasses, and the
weights either as numpy arrays through the object store (put once, shared by every actor) or as
a path the actor loads itself. No model code is pickled: the actor imports it.

`RayInstance` is the controller-side proxy. It keeps a snapshot of the actor's state (clock, work,
KV load, which groups' prompts are cached, in-flight progress) returned by every step, so the
controller's placement questions cost no round trip; `submit`, `abort` and `set_now` are sent
without waiting (an actor runs its calls in order, so they land before its next step). Steps can
be started on every instance at once (`start_step`) and collected afterwards (`finish_step`):
what `ConcurrentDriver` does. An actor that dies, raises from a step, or does not answer within
`step_timeout_s` raises `InstanceLostError` (and is killed, so a hung process does not linger).

Weights: `RayInstanceGroup.update_params(params, version)` puts the new weights into the object
store once and every actor applies them between two steps, only when it has no chunk in flight
(the engine refuses otherwise), so no response mixes two versions.

Multi-host slices (`RayBackendConfig.hosts_per_slice` = H > 1): a slice is H actors, one per
host bundle, that join one `jax.distributed` cluster (the leader, host 0, picks a free port on
its node; the others connect to it) and build the same engine over the global mesh of all their
devices. Every state-changing call (submit, abort, set_now, step, update_params, reset with the
slice's new instance id, fault injection, kill) goes to all H actors in the same order, so their
host-side schedulers stay identical and their device steps run as one SPMD program. The proxy
answers from the leader's results; the followers return a digest of theirs, checked against the
leader's. KV moving between slices is written by the leader only (so the pool records the
leader as the writer of the slice's blobs), and a KV handle is resolved once by the proxy so
that every host imports the same blob (or none). A host that dies, raises or hangs loses the
whole slice.

Lost actors: the proxy kills every actor of a lost slice and tells the KV pool (`writer_lost`,
with the leader's actor id) to drop the blobs it wrote: they died with it, and their requests
re-prefill. Replacement (`replace_lost=True`, single-host slices only): the group is the
`ConcurrentDriver`'s replacer. For a lost actor it starts a new one in the lost actor's
placement-group bundle (freed when it was killed) with the group's current weights and version
and the current KV pool; the rollout goes on while it starts, and once it answers the driver
registers it with the controller as a new instance (the next id). `reset()` numbers the live
slices 0..N-1 again for the next rollout. A lost multi-host slice is not replaced
(`replace_lost` with `hosts_per_slice` > 1 is a ConfigError): the rollout goes on with the
slices left.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.config import ModelConfig
from seer_jax.rollout.instance import InstanceLostError, KVPool
from seer_jax.rollout.ray_cluster import RayBackendConfig, ensure_ray, pin_to_cpu_core
from seer_jax.rollout.types import ChunkRequest, InstanceLoad, StepReport

PLACEMENT_TIMEOUT_S = 60.0  # how long to wait for the cluster to fit the placement group
ACTOR_FAULTS = ("raise", "hang", "kill_on_kv_load")
Weights = Mapping[str, Any] | str  # a params tree of arrays, or a model name/path to load
PoolFactory = Callable[[int | None], KVPool]  # capacity_bytes -> a pool every actor can use


@dataclasses.dataclass
class ActorSnapshot:
    now: float
    has_work: bool
    load: InstanceLoad
    resident: dict[str, int]  # group_id -> tokens of its prompt cached on the actor
    progress: dict[str, int]
    params_version: int
    pid: int


def numpy_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A params tree as host numpy arrays (what goes into the object store)."""
    return {k: numpy_params(v) if isinstance(v, Mapping) else np.asarray(v)
            for k, v in params.items()}


class EngineActor:
    """The actor's class (wrapped with `ray.remote` by `make_ray_instances`)."""

    def __init__(self, instance_id: int, cfg: ModelConfig, weights: Weights, dtype: str,
                 engine_config: EngineConfig, tp: int, pool: KVPool,
                 eos_ids: tuple[int, ...] | None, record_steps: bool, params_version: int = 0,
                 host: int = 0, hosts: int = 1):
        """params_version: the version of `weights` (a replacement starts at the group's);
        host, hosts: this actor's place in a slice of `hosts` actors; with hosts > 1 nothing
        touches jax here (`jax.distributed` must start first): `join` builds the engine once
        every host of the slice has started."""
        pin_to_cpu_core()  # RayBackendConfig.pin_cpus, before XLA starts its thread pool
        self.instance_id = instance_id
        self.host, self.hosts, self.tp = host, hosts, tp
        self.engine_config = engine_config
        self.base_pool = pool
        self.pool = _HostPool(pool, leader=host == 0) if hosts > 1 else pool
        self.eos_ids = eos_ids
        self.record_steps = record_steps
        self.cfg, self.params, self.dtype = cfg, weights, dtype
        self.params_version = params_version
        self.fault: str | None = None
        self.inst = None
        if hosts == 1:
            self.devices = self._local_devices()
            self._build()

    def _local_devices(self) -> list:
        """This host's devices of the slice (loading the weights first when given a path)."""
        import jax

        devices = jax.local_devices()
        per_host = self.tp // self.hosts
        if len(devices) < per_host:
            raise SeerError(f"actor {self.instance_id}/{self.host}: tp={self.tp} over {self.hosts} "
                            f"host(s) needs {per_host} devices per host, this process sees "
                            f"{len(devices)} ({devices[0].platform})")
        if isinstance(self.params, str):
            from seer_jax.model import load

            self.cfg, self.params, _ = load(self.params, self.dtype)
        return devices[:per_host]

    def coordinator(self) -> str:
        """(Leader) the `jax.distributed` coordinator address: this node's address and a port
        free on it."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator: str, timeout_s: int = 300) -> int:
        """Join the slice's `jax.distributed` cluster (every host of the slice at once) and build
        the engine over the global mesh of the slice's devices; returns the process index."""
        import jax

        if os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.hosts,
                                   process_id=self.host, initialization_timeout=timeout_s)
        self._local_devices()
        devices = jax.devices()
        if len(devices) != self.tp:
            raise SeerError(f"actor {self.instance_id}/{self.host}: the slice's {self.hosts} hosts "
                            f"hold {len(devices)} devices; tp={self.tp} needs exactly that many")
        self.devices = devices
        self._build()
        return jax.process_index()

    def _build(self) -> None:
        from jax.sharding import Mesh

        from seer_jax.engine.engine import Engine
        from seer_jax.rollout.engine_instance import EngineInstance

        mesh = Mesh(np.array(self.devices), ("tp",))
        engine = Engine(self.cfg, self.params, self.engine_config, mesh=mesh, eos_ids=self.eos_ids)
        self.inst = EngineInstance(self.instance_id, engine, self.pool,
                                   record_steps=self.record_steps)
        self.ran: set[str] = set()  # requests that had a chunk submitted here

    def snapshot(self) -> ActorSnapshot:
        inst = self.inst
        return ActorSnapshot(
            now=inst.now(), has_work=inst.has_work(), load=inst.load(),
            resident={g: n for g in inst._prompts if (n := inst.resident_tokens("", g))},
            progress=inst.running_progress(), params_version=self.params_version,
            pid=os.getpid())

    def submit(self, chunk: ChunkRequest, kv_refs: list | None = None) -> None:
        """kv_refs (multi-host slices): the chunk's KV handle as the proxy resolved it, [ref] or
        [] (missing), so that every host imports the same blob or none."""
        if kv_refs is not None and chunk.kv_handle is not None:
            self.pool.resolve(chunk.kv_handle, kv_refs)
        if (self.fault == "kill_on_kv_load" and chunk.kv_handle is not None
                and chunk.request_id not in self.ran):
            # KV another actor wrote: the process dies once the blob is fetched, before the
            # engine installs it
            self.pool.get(chunk.kv_handle)
            os._exit(1)
        self.ran.add(chunk.request_id)
        self.inst.submit(chunk)

    def set_now(self, t: float) -> None:
        self.inst.set_now(t)

    def abort(self, request_id: str) -> None:
        self.inst.abort(request_id)

    def step(self) -> tuple[StepReport, ActorSnapshot] | tuple[tuple, None]:
        """The leader's report and snapshot; a follower returns the digest of its report."""
        if self.fault == "raise":
            raise SeerError(f"injected fault on instance {self.instance_id}")
        if self.fault == "hang":
            time.sleep(3600)
        rep = self.inst.step()
        if self.host > 0:
            return report_digest(rep), None
        return rep, self.snapshot()

    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests and demos: the next step raises ("raise") or hangs ("hang"),
        or the process exits while importing KV that another actor wrote ("kill_on_kv_load")."""
        if kind not in ACTOR_FAULTS:
            raise SeerError(f"fault {kind!r} is unknown; allowed: {list(ACTOR_FAULTS)}")
        self.fault = kind

    def set_instance_id(self, instance_id: int) -> None:
        self.instance_id = self.inst.instance_id = instance_id

    def update_params(self, version: int, params: Mapping[str, Any]) -> int:
        """New weights between steps; refused (SeerError) while chunks are in flight here."""
        self.inst.engine.update_params(params)
        self.params, self.params_version = params, version
        return version

    def reset(self, pool: KVPool | None = None, instance_id: int | None = None) -> ActorSnapshot:
        """A fresh engine (empty caches, clock 0, empty step log) with the current weights, and
        a new KV pool and instance id when given."""
        self.base_pool = pool or self.base_pool
        self.pool = (_HostPool(self.base_pool, leader=self.host == 0) if self.hosts > 1
                     else self.base_pool)
        self.instance_id = self.instance_id if instance_id is None else instance_id
        self._build()
        return self.snapshot()

    def step_log(self) -> list:
        return list(self.inst.step_log or [])


def report_digest(rep: StepReport) -> tuple:
    """What every host of a slice must agree on after a step: the tokens each chunk got."""
    return tuple((r.request_id, tuple(r.new_token_ids), r.finish_reason) for r in rep.finished)



class _HostPool:
    """The KV pool as one host of a multi-host slice sees it: handles were resolved by the proxy
    (`resolve`) so every host imports the same blob, and only the leader writes (every host holds
    the same full KV of a finished chunk) and reports reads to the directory."""

    def __init__(self, pool: Any, leader: bool):
        self.pool, self.leader = pool, leader
        self._resolved: dict[str, list] = {}

    def resolve(self, handle: str, refs: list) -> None:
        self._resolved[handle] = refs

    def get(self, handle: str) -> object | None:
        refs = self._resolved.pop(handle, [])
        if not refs:
            return None
        return self.pool.fetch(handle, refs, report=self.leader)

    def put(self, request_id: str, blob: object, nbytes: int) -> str:
        return self.pool.put(request_id, blob, nbytes) if self.leader else ""


class RayInstance:
    """Controller-side proxy of one slice: one `EngineActor`, or the actors of a multi-host
    slice (leader first); implements `Instance`."""

    def __init__(self, instance_id: int, actor: Any, snapshot: ActorSnapshot, step_timeout_s: float,
                 followers: Sequence[Any] = (), pool: Any = None, bundle_index: int = 0,
                 pipeline_depth: int = 1):
        """followers: the other hosts' actors of a multi-host slice; pool: the KV pool (its
        handles are resolved here for a multi-host slice, and it is told when the slice is lost,
        so the KV its leader wrote is dropped); bundle_index: the leader's placement-group
        bundle; pipeline_depth: how many steps `ConcurrentDriver` keeps queued on the actor."""
        self.instance_id = instance_id
        self.actor = actor
        self.actors = [actor, *followers]
        self.pool = pool
        self.snap = snapshot
        self.step_timeout_s = step_timeout_s
        self.bundle_index = bundle_index  # its placement-group bundle
        self.lost = False
        self.killed = False  # `kill` was called (the actors may still answer for a moment)
        self._submits: list = []  # refs of submits sent since the last step was started
        # steps started and not finished: (step refs, refs of the submits sent before it)
        self._started: collections.deque = collections.deque()
        self.pipeline_depth = pipeline_depth

    # ---- Instance -------------------------------------------------------------------------------
    def now(self) -> float:
        return self.snap.now

    def set_now(self, t: float) -> None:
        if t > self.snap.now:
            self.snap.now = t
            for a in self.actors:
                a.set_now.remote(t)

    def submit(self, chunk: ChunkRequest) -> None:
        if self.lost:
            raise InstanceLostError(f"instance {self.instance_id} is lost")
        if len(self.actors) == 1:
            self._submits.append(self.actor.submit.remote(chunk))
        else:
            refs = self._resolve(chunk.kv_handle)
            self._submits.extend(a.submit.remote(chunk, refs) for a in self.actors)
        self.snap.has_work = True

    def _resolve(self, handle: str | None) -> list:
        """A KV handle as [object ref] or [] (missing), read once for every host of the slice."""
        if handle is None or self.pool is None:
            return []
        import ray

        return ray.get(self.pool.directory.get.remote(handle)) or []

    def has_work(self) -> bool:
        return self.snap.has_work

    def load(self) -> InstanceLoad:
        return self.snap.load

    def resident_tokens(self, request_id: str, group_id: str) -> int:
        return self.snap.resident.get(group_id, 0)

    def running_progress(self) -> dict[str, int]:
        return dict(self.snap.progress)

    def abort(self, request_id: str) -> None:
        for a in self.actors:
            a.abort.remote(request_id)

    def inject_fault(self, kind: str, host: int | None = None) -> None:
        """Arm a fault (`EngineActor.inject_fault`) on every host of the slice (or on `host`
        only); it lands before later calls."""
        for h, a in enumerate(self.actors):
            if host is None or h == host:
                a.inject_fault.remote(kind)

    def step(self) -> StepReport:
        return self.finish_step(self.start_step())

    # ---- concurrent stepping and faults ---------------------------------------------------------
    def start_step(self) -> Any:
        if self.lost:
            raise InstanceLostError(f"instance {self.instance_id} is lost")
        refs = [a.step.remote() for a in self.actors]
        self._started.append((refs, self._submits))
        self._submits = []
        return refs

    def finish_step(self, refs: Any) -> StepReport:
        """The report of the oldest started step (`refs`, from `start_step`). The snapshot it
        brings is the actor's state at the end of that step; chunks submitted after the step was
        started are not in it, so the instance still counts as having work."""
        import ray

        started, submits = self._started.popleft()
        if started is not refs:
            raise SeerError(f"instance {self.instance_id}: steps must be finished in the order "
                            "they were started")
        (rep, snap), *followers = self._get(refs, self.step_timeout_s)
        digest = report_digest(rep)
        for h, (other, _) in enumerate(followers, 1):
            if other != digest:
                self._lose(f"host {h} diverged from the slice's leader")
        try:
            ray.get(submits)  # done already: the actor ran them before this step
        except ray.exceptions.RayTaskError as e:
            raise SeerError(f"instance {self.instance_id} refused a chunk: {e.cause}") from None
        self.snap = snap
        if self._submits or any(later for _, later in self._started):
            self.snap.has_work = True
        return rep

    def check_alive(self, timeout_s: float = 30.0) -> None:
        """Raise InstanceLostError unless every host's actor answers within timeout_s. After
        `kill`, wait (up to timeout_s) until the actors are found gone: `ray.kill` is
        asynchronous, and a call sent right after it may still be answered."""
        if not self.killed:
            self.snap = self._get([a.snapshot.remote() for a in self.actors], timeout_s)[0]
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # _get raises once a killed actor is gone
            self._get([a.snapshot.remote() for a in self.actors],
                      max(0.0, deadline - time.monotonic()))
            time.sleep(0.01)
        self._lose(f"still answering {timeout_s:g} s after it was killed")

    def kill(self) -> None:
        import ray

        self.killed = True
        for a in self.actors:
            ray.kill(a, no_restart=True)

    def _get(self, refs: list, timeout_s: float) -> list:
        """Every host's answer, or InstanceLostError (and the slice killed) as soon as one host
        dies or raises, or when not all answered within timeout_s."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1,
                                          timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise ray.exceptions.GetTimeoutError()
                ray.get(ready)  # raises at once when that host died or raised
            return ray.get(refs)
        except ray.exceptions.GetTimeoutError:
            why = f"no answer within {timeout_s:g} s"
        except ray.exceptions.RayActorError as e:
            why = f"actor died ({type(e).__name__})"
        except ray.exceptions.RayTaskError as e:
            why = f"step raised {type(e.cause).__name__}: {e.cause}"
        self._lose(why)

    def _lose(self, why: str) -> None:
        self.lost = True
        self._started.clear()
        self.kill()
        if hasattr(self.pool, "writer_lost"):  # its KV blobs died with it (the leader wrote them)
            self.pool.writer_lost(self.actor._actor_id.hex())
        raise InstanceLostError(f"instance {self.instance_id} lost: {why}")


@dataclasses.dataclass
class ActorSpec:
    """What starting an engine actor takes (kept by the group to start replacements)."""

    cfg: ModelConfig
    weights: Any  # object ref of numpy params, or a model name/path each actor loads
    dtype: str
    engine_config: EngineConfig
    tp: int
    eos_ids: tuple[int, ...] | None
    record_steps: bool
    backend: RayBackendConfig


class RayInstanceGroup:
    """The actors of one rollout deployment: their proxies, the KV pool, weight sync,
    replacement of lost actors (the driver's `Replacer`), shutdown."""

    def __init__(self, instances: list[RayInstance], pool: KVPool, placement_group: Any,
                 pool_capacity_bytes: int | None = None, spec: ActorSpec | None = None,
                 replace_lost: bool = False, pool_factory: PoolFactory | None = None):
        self.instances = instances
        self.pool = pool
        self.pool_capacity_bytes = pool_capacity_bytes
        self.pool_factory = pool_factory
        self.placement_group = placement_group
        self.params_version = 0
        self.spec = spec
        self.replace_lost = replace_lost
        # replacements started and not joined yet: (lost id, bundle index, actor, snapshot ref)
        self._pending: list[tuple[int, int, Any, Any]] = []
        self.failed_replacements: dict[int, str] = {}  # lost id -> why its replacement failed

    def update_params(self, params: Mapping[str, Any], version: int | None = None) -> int:
        """Push new weights to every live actor through the object store (put once); returns the
        version. Call between rollouts: an actor with chunks in flight refuses."""
        import ray

        self._join_all()
        version = self.params_version + 1 if version is None else version
        live = [i for i in self.instances if not i.lost]
        busy = [i.instance_id for i in live if i.has_work()]
        if busy:  # checked before any actor changes: all actors move to the new version or none
            raise SeerError(f"update_params with chunks in flight on instances {busy}; "
                            "sync between rollouts")
        ref = ray.put(numpy_params(params))
        got = ray.get([a.update_params.remote(version, ref) for i in live for a in i.actors])
        for inst in live:
            inst.snap.params_version = version
        assert got == [version] * len(got)
        self.params_version = version
        if self.spec is not None:  # replacements start with these weights
            self.spec = dataclasses.replace(self.spec, weights=ref)
        return version

    def reset(self) -> None:
        """Fresh engines and a fresh KV pool (zeroed counters) on every live actor, between
        independent rollouts; lost actors are dropped and the live ones numbered 0..N-1."""
        import ray

        from seer_jax.rollout.ray_pool import RayKVPool

        self._join_all()
        make = self.pool_factory or RayKVPool.create
        old, self.pool = self.pool, make(self.pool_capacity_bytes)
        live = [i for i in self.instances if not i.lost]
        refs = [[a.reset.remote(self.pool, k) for a in i.actors] for k, i in enumerate(live)]
        for k, (inst, snaps) in enumerate(zip(live, refs, strict=True)):
            inst.instance_id, inst.snap, inst.pool = k, ray.get(snaps)[0], self.pool  # the leader's
        self.instances = live
        if hasattr(old, "shutdown"):
            old.shutdown()

    # ---- replacement (the ConcurrentDriver's Replacer) ------------------------------------------
    def replacer(self) -> RayInstanceGroup | None:
        """What to hand `rollout(replacer=...)`: this group when it replaces lost actors."""
        return self if self.replace_lost else None

    def replace(self, lost_id: int) -> None:
        """Start an actor in lost instance `lost_id`'s bundle, with the current weights."""
        if self.spec is None:
            raise SeerError("this group cannot start actors (built without an ActorSpec)")
        if self.spec.backend.hosts_per_slice > 1:
            raise SeerError("a lost multi-host slice is not replaced (hosts_per_slice="
                            f"{self.spec.backend.hosts_per_slice})")
        lost = next(i for i in self.instances if i.instance_id == lost_id)
        actor = _start_actor(self.spec, self.placement_group, lost.bundle_index, -1, self.pool,
                             self.params_version)
        self._pending.append((lost_id, lost.bundle_index, actor, actor.snapshot.remote()))

    def pending_replacements(self) -> int:
        return len(self._pending)

    def joined(self, next_id: int, wait: bool) -> list[tuple[int, RayInstance]]:
        """Replacements whose actor answers, as (lost id, instance numbered from next_id on);
        with `wait`, block until one answers or every pending one has failed."""
        import ray

        out: list[tuple[int, RayInstance]] = []
        timeout = self.spec.backend.step_timeout_s if self.spec else PLACEMENT_TIMEOUT_S
        while self._pending and not out:
            refs = [p[3] for p in self._pending]
            done, _ = ray.wait(refs, num_returns=1 if wait else len(refs),
                               timeout=timeout if wait else 0)
            if wait and not done:  # none answered in time: they count as failed
                done = refs
            done_set = set(done)
            for entry in [p for p in self._pending if p[3] in done_set]:
                self._pending.remove(entry)
                lost_id, bundle, actor, ref = entry
                try:
                    snap = ray.get(ref, timeout=0)
                except Exception as e:  # the actor failed to start (or to answer in time)
                    self.failed_replacements[lost_id] = f"{type(e).__name__}: {e}"
                    ray.kill(actor, no_restart=True)
                    continue
                iid = next_id + len(out)
                actor.set_instance_id.remote(iid)
                inst = RayInstance(iid, actor, snap, timeout, bundle_index=bundle, pool=self.pool,
                                   pipeline_depth=self.spec.backend.pipeline_depth)
                self.instances.append(inst)
                out.append((lost_id, inst))
            if not wait:
                break
        return out

    def _join_all(self) -> None:
        while self._pending:
            self.joined(len(self.instances), wait=True)

    # ---- inspection and teardown ----------------------------------------------------------------
    def step_logs(self) -> list:
        import ray

        live = [i for i in self.instances if not i.lost]
        return [row for rows in ray.get([i.actor.step_log.remote() for i in live]) for row in rows]

    @property
    def lost(self) -> list[int]:
        return [i.instance_id for i in self.instances if i.lost]

    def shutdown(self) -> None:
        import ray

        for inst in self.instances:
            for a in inst.actors:
                ray.kill(a, no_restart=True)
        for *_, actor, _ in self._pending:
            ray.kill(actor, no_restart=True)
        self._pending = []
        if hasattr(self.pool, "shutdown"):
            self.pool.shutdown()
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)


def _start_actor(spec: ActorSpec, pg: Any, bundle_index: int, instance_id: int, pool: KVPool,
                 params_version: int, host: int = 0) -> Any:
    """The engine actor of host `host` of a slice in bundle `bundle_index` of placement group
    `pg` (returns at once; with hosts_per_slice > 1 it builds its engine in `join`)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    backend = spec.backend
    per_host = spec.tp // backend.hosts_per_slice
    opts: dict[str, Any] = dict(
        num_cpus=backend.bundle(spec.tp).get("CPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle_index),
        runtime_env={"env_vars": backend.actor_env(spec.tp, bundle_index)},
        max_restarts=0)
    if backend.resource == "GPU":
        opts["num_gpus"] = per_host
    elif backend.resource == "TPU":
        opts["resources"] = {"TPU": per_host}
    return ray.remote(EngineActor).options(**opts).remote(
        instance_id, spec.cfg, spec.weights, spec.dtype, spec.engine_config, spec.tp, pool,
        spec.eos_ids, spec.record_steps, params_version, host, backend.hosts_per_slice)


def make_ray_instances(cfg: ModelConfig, weights: Weights, *, num_instances: int, tp: int,
                       engine_config: EngineConfig, backend: RayBackendConfig | None = None,
                       dtype: str = "float32", eos_ids: Sequence[int] | None = None,
                       pool_capacity_bytes: int | None = None,
                       record_steps: bool = False, replace_lost: bool = False,
                       pool_factory: PoolFactory | None = None) -> RayInstanceGroup:
    """Start the engine actors, one per slice host (`backend.hosts_per_slice` per slice; the
    placement group has one bundle per host), sharing a KV pool: `pool_factory(capacity_bytes)`
    (called once Ray is up, and again by `reset()`), by default the object-store `RayKVPool`.
    weights: a params tree (sent as numpy arrays, one object-store copy) or a model name/path
    each actor loads itself. replace_lost: start a replacement for every actor lost during a
    rollout (the group is then `rollout`'s replacer); single-host slices only."""
    from seer_jax.rollout.ray_pool import RayKVPool

    backend = (backend or RayBackendConfig()).validate()
    hosts = backend.hosts_per_slice
    backend.check_tp(tp)
    if replace_lost and hosts > 1:
        raise ConfigError(f"ray replace_lost=True is invalid with hosts_per_slice={hosts}; "
                          "allowed: replace_lost=False for slices spanning several hosts (a lost "
                          "multi-host slice is not replaced), or hosts_per_slice=1")
    ray = ensure_ray(backend, min_cpus=num_instances * hosts)

    bundle = backend.bundle(tp)
    pg = ray.util.placement_group([dict(bundle) for _ in range(num_instances * hosts)],
                                  strategy=backend.strategy)
    try:
        ray.get(pg.ready(), timeout=min(backend.step_timeout_s, PLACEMENT_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise SeerError(
            f"the cluster cannot place {num_instances * hosts} bundles of {bundle} "
            f"(strategy {backend.strategy}); available: {ray.available_resources()}") from None
    pool = (pool_factory or RayKVPool.create)(pool_capacity_bytes)
    spec = ActorSpec(cfg=cfg, weights=weights if isinstance(weights, str) else ray.put(numpy_params(weights)),
                     dtype=dtype, engine_config=engine_config, tp=tp,
                     eos_ids=tuple(eos_ids) if eos_ids is not None else None,
                     record_steps=record_steps, backend=backend)
    slices = [[_start_actor(spec, pg, i * hosts + h, i, pool, 0, h) for h in range(hosts)]
              for i in range(num_instances)]
    if hosts > 1:  # every host of a slice joins its leader's jax.distributed cluster at once
        leaders = ray.get([actors[0].coordinator.remote() for actors in slices],
                          timeout=backend.step_timeout_s)
        timeout = int(backend.step_timeout_s)
        ray.get([a.join.remote(addr, timeout) for addr, actors in zip(leaders, slices, strict=True)
                 for a in actors], timeout=backend.step_timeout_s)
    snaps = ray.get([actors[0].snapshot.remote() for actors in slices],
                    timeout=backend.step_timeout_s)
    instances = [RayInstance(i, actors[0], s, backend.step_timeout_s, followers=actors[1:],
                             pool=pool, bundle_index=i * hosts,
                             pipeline_depth=backend.pipeline_depth)
                 for i, (actors, s) in enumerate(zip(slices, snaps, strict=True))]
    return RayInstanceGroup(instances, pool, pg, pool_capacity_bytes, spec, replace_lost,
                            pool_factory)
