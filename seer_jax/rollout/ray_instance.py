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
(the engine refuses otherwise), so no response mixes two versions. A multi-host slice (one actor
per host under `jax.distributed`) is not built here: each slice is one actor on one host.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import SeerError
from seer_jax.model.config import ModelConfig
from seer_jax.rollout.instance import InstanceLostError, KVPool
from seer_jax.rollout.ray_cluster import RayBackendConfig, ensure_ray
from seer_jax.rollout.types import ChunkRequest, InstanceLoad, StepReport

PLACEMENT_TIMEOUT_S = 60.0  # how long to wait for the cluster to fit the placement group
Weights = Mapping[str, Any] | str  # a params tree of arrays, or a model name/path to load


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
                 eos_ids: tuple[int, ...] | None, record_steps: bool):
        import jax

        devices = jax.local_devices()
        if len(devices) < tp:
            raise SeerError(f"actor {instance_id}: tp={tp} needs {tp} devices, this process sees "
                            f"{len(devices)} ({devices[0].platform})")
        self.instance_id = instance_id
        self.devices = devices[:tp]
        self.engine_config = engine_config
        self.pool = pool
        self.eos_ids = eos_ids
        self.record_steps = record_steps
        if isinstance(weights, str):
            from seer_jax.model import load

            cfg, weights, _ = load(weights, dtype)
        self.cfg = cfg
        self.params = weights
        self.params_version = 0
        self.fault: str | None = None
        self._build()

    def _build(self) -> None:
        from jax.sharding import Mesh

        from seer_jax.engine.engine import Engine
        from seer_jax.rollout.engine_instance import EngineInstance

        mesh = Mesh(np.array(self.devices), ("tp",))
        engine = Engine(self.cfg, self.params, self.engine_config, mesh=mesh, eos_ids=self.eos_ids)
        self.inst = EngineInstance(self.instance_id, engine, self.pool,
                                   record_steps=self.record_steps)

    def snapshot(self) -> ActorSnapshot:
        inst = self.inst
        return ActorSnapshot(
            now=inst.now(), has_work=inst.has_work(), load=inst.load(),
            resident={g: n for g in inst._prompts if (n := inst.resident_tokens("", g))},
            progress=inst.running_progress(), params_version=self.params_version,
            pid=os.getpid())

    def submit(self, chunk: ChunkRequest) -> None:
        self.inst.submit(chunk)

    def set_now(self, t: float) -> None:
        self.inst.set_now(t)

    def abort(self, request_id: str) -> None:
        self.inst.abort(request_id)

    def step(self) -> tuple[StepReport, ActorSnapshot]:
        if self.fault == "raise":
            raise SeerError(f"injected fault on instance {self.instance_id}")
        if self.fault == "hang":
            time.sleep(3600)
        rep = self.inst.step()
        return rep, self.snapshot()

    def inject_fault(self, kind: str) -> None:
        """Fault injection for tests and demos: the next step raises ("raise") or hangs ("hang")."""
        self.fault = kind

    def update_params(self, version: int, params: Mapping[str, Any]) -> int:
        """New weights between steps; refused (SeerError) while chunks are in flight here."""
        self.inst.engine.update_params(params)
        self.params, self.params_version = params, version
        return version

    def reset(self, pool: KVPool | None = None) -> ActorSnapshot:
        """A fresh engine (empty caches, clock 0, empty step log) with the current weights, and
        a new KV pool when given."""
        self.pool = pool or self.pool
        self._build()
        return self.snapshot()

    def step_log(self) -> list:
        return list(self.inst.step_log or [])


class RayInstance:
    """Controller-side proxy of one `EngineActor`; implements `Instance`."""

    def __init__(self, instance_id: int, actor: Any, snapshot: ActorSnapshot, step_timeout_s: float):
        self.instance_id = instance_id
        self.actor = actor
        self.snap = snapshot
        self.step_timeout_s = step_timeout_s
        self.lost = False
        self._submits: list = []  # refs of submits sent since the last step

    # ---- Instance -------------------------------------------------------------------------------
    def now(self) -> float:
        return self.snap.now

    def set_now(self, t: float) -> None:
        if t > self.snap.now:
            self.snap.now = t
            self.actor.set_now.remote(t)

    def submit(self, chunk: ChunkRequest) -> None:
        if self.lost:
            raise InstanceLostError(f"instance {self.instance_id} is lost")
        self._submits.append(self.actor.submit.remote(chunk))
        self.snap.has_work = True

    def has_work(self) -> bool:
        return self.snap.has_work

    def load(self) -> InstanceLoad:
        return self.snap.load

    def resident_tokens(self, request_id: str, group_id: str) -> int:
        return self.snap.resident.get(group_id, 0)

    def running_progress(self) -> dict[str, int]:
        return dict(self.snap.progress)

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)

    def step(self) -> StepReport:
        return self.finish_step(self.start_step())

    # ---- concurrent stepping and faults ---------------------------------------------------------
    def start_step(self) -> Any:
        if self.lost:
            raise InstanceLostError(f"instance {self.instance_id} is lost")
        return self.actor.step.remote()

    def finish_step(self, ref: Any) -> StepReport:
        import ray

        submits, self._submits = self._submits, []
        rep, snap = self._get(ref, self.step_timeout_s)
        try:
            ray.get(submits)  # done already: the actor ran them before this step
        except ray.exceptions.RayTaskError as e:
            raise SeerError(f"instance {self.instance_id} refused a chunk: {e.cause}") from None
        self.snap = snap
        return rep

    def check_alive(self, timeout_s: float = 30.0) -> None:
        """Raise InstanceLostError unless the actor answers within timeout_s."""
        self.snap = self._get(self.actor.snapshot.remote(), timeout_s)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def _get(self, ref: Any, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            why = f"no answer within {timeout_s:g} s"
        except ray.exceptions.RayActorError as e:
            why = f"actor died ({type(e).__name__})"
        except ray.exceptions.RayTaskError as e:
            why = f"step raised {type(e.cause).__name__}: {e.cause}"
        self.lost = True
        self.kill()
        raise InstanceLostError(f"instance {self.instance_id} lost: {why}")


class RayInstanceGroup:
    """The actors of one rollout deployment: their proxies, the KV pool, weight sync, shutdown."""

    def __init__(self, instances: list[RayInstance], pool: KVPool, placement_group: Any,
                 pool_capacity_bytes: int | None = None):
        self.instances = instances
        self.pool = pool
        self.pool_capacity_bytes = pool_capacity_bytes
        self.placement_group = placement_group
        self.params_version = 0

    def update_params(self, params: Mapping[str, Any], version: int | None = None) -> int:
        """Push new weights to every live actor through the object store (put once); returns the
        version. Call between rollouts: an actor with chunks in flight refuses."""
        import ray

        version = self.params_version + 1 if version is None else version
        live = [i for i in self.instances if not i.lost]
        busy = [i.instance_id for i in live if i.has_work()]
        if busy:  # checked before any actor changes: all actors move to the new version or none
            raise SeerError(f"update_params with chunks in flight on instances {busy}; "
                            "sync between rollouts")
        ref = ray.put(numpy_params(params))
        got = ray.get([i.actor.update_params.remote(version, ref) for i in live])
        for inst in live:
            inst.snap.params_version = version
        assert got == [version] * len(live)
        self.params_version = version
        return version

    def reset(self) -> None:
        """Fresh engines and a fresh KV pool (zeroed counters) on every live actor, between
        independent rollouts."""
        import ray

        from seer_jax.rollout.ray_pool import RayKVPool

        old, self.pool = self.pool, RayKVPool.create(self.pool_capacity_bytes)
        live = [i for i in self.instances if not i.lost]
        snaps = ray.get([i.actor.reset.remote(self.pool) for i in live])
        for inst, snap in zip(live, snaps, strict=True):
            inst.snap = snap
        if hasattr(old, "shutdown"):
            old.shutdown()

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
            ray.kill(inst.actor, no_restart=True)
        if hasattr(self.pool, "shutdown"):
            self.pool.shutdown()
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)


def make_ray_instances(cfg: ModelConfig, weights: Weights, *, num_instances: int, tp: int,
                       engine_config: EngineConfig, backend: RayBackendConfig | None = None,
                       dtype: str = "float32", eos_ids: Sequence[int] | None = None,
                       pool_capacity_bytes: int | None = None,
                       record_steps: bool = False) -> RayInstanceGroup:
    """Start one engine actor per slice (placement group: one bundle per slice host) sharing an
    object-store KV pool. weights: a params tree (sent as numpy arrays, one object-store copy)
    or a model name/path each actor loads itself."""
    from seer_jax.rollout.ray_pool import RayKVPool

    backend = (backend or RayBackendConfig()).validate()
    ray = ensure_ray(backend, min_cpus=num_instances)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = backend.bundle(tp)
    pg = ray.util.placement_group([dict(bundle) for _ in range(num_instances)],
                                  strategy=backend.strategy)
    try:
        ray.get(pg.ready(), timeout=min(backend.step_timeout_s, PLACEMENT_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise SeerError(
            f"the cluster cannot place {num_instances} bundles of {bundle} "
            f"(strategy {backend.strategy}); available: {ray.available_resources()}") from None
    pool = RayKVPool.create(pool_capacity_bytes)
    weights_arg = weights if isinstance(weights, str) else ray.put(numpy_params(weights))
    actor_cls = ray.remote(EngineActor)
    actors = []
    for i in range(num_instances):
        opts: dict[str, Any] = dict(
            num_cpus=bundle.get("CPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i),
            runtime_env={"env_vars": backend.actor_env(tp)},
            max_restarts=0)
        if backend.resource == "GPU":
            opts["num_gpus"] = tp
        elif backend.resource == "TPU":
            opts["resources"] = {"TPU": tp}
        actors.append(actor_cls.options(**opts).remote(
            i, cfg, weights_arg, dtype, engine_config, tp, pool,
            tuple(eos_ids) if eos_ids is not None else None, record_steps))
    snaps = ray.get([a.snapshot.remote() for a in actors], timeout=backend.step_timeout_s)
    instances = [RayInstance(i, a, s, backend.step_timeout_s)
                 for i, (a, s) in enumerate(zip(actors, snaps, strict=True))]
    return RayInstanceGroup(instances, pool, pg, pool_capacity_bytes)
