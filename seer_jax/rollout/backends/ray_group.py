"""Mesh slices as Ray actors: `make_ray_instances` starts them and returns a `RayInstanceGroup`.

The actors (`ray_actor.EngineActor`) are placed with a placement group, one bundle per slice host
(`RayBackendConfig`); the controller talks to each slice through its proxy
(`ray_proxy.RayInstance`).

Weights: `RayInstanceGroup.update_params(params, version)` puts the new weights into the object
store once and every actor applies them between two steps, only when it has no chunk in flight
(the engine refuses otherwise), so no response mixes two versions.

Multi-host slices (`RayBackendConfig.hosts_per_slice` = H > 1): the group starts H actors per
slice and has every host join its leader's `jax.distributed` cluster; update_params and reset
(with the slice's new instance id) go to all H actors.

Replacement (`replace_lost=True`, single-host slices only): the group is the
`ConcurrentDriver`'s replacer. For a lost actor it starts a new one in the lost actor's
placement-group bundle (freed when it was killed) with the group's current weights and version
and the current KV pool; the rollout goes on while it starts, and once it answers the driver
registers it with the controller as a new instance (the next id). `reset()` numbers the live
slices 0..N-1 again for the next rollout. A lost multi-host slice is not replaced
(`replace_lost` with `hosts_per_slice` > 1 is a ConfigError): the rollout goes on with the
slices left.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from seer_jax.drafting.replicated import SyncConfig
from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.config import ModelConfig
from seer_jax.rollout.backends.ray_actor import LIVENESS_GROUP, EngineActor, Weights, numpy_params
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig, ensure_ray
from seer_jax.rollout.backends.ray_proxy import RayInstance
from seer_jax.rollout.core.instance import KVPool

PLACEMENT_TIMEOUT_S = 60.0  # how long to wait for the cluster to fit the placement group
log = logging.getLogger(__name__)


class ActorStartupError(SeerError):
    """Engine actors did not start (import, load the weights, build the engine) in time."""


def proxy(backend: RayBackendConfig, instance_id: int, actors: Sequence[Any], snapshot: Any,
          pool: Any, bundle_index: int) -> RayInstance:
    """The controller-side proxy of one slice's actors (leader first)."""
    return RayInstance(instance_id, actors[0], snapshot, backend.step_timeout_s,
                       followers=actors[1:], pool=pool, bundle_index=bundle_index,
                       pipeline_depth=backend.pipeline_depth,
                       step_timeout_factor=backend.step_timeout_factor,
                       liveness_interval_s=backend.liveness_interval_s,
                       liveness_timeout_s=backend.liveness_timeout_s)


def await_startup(refs: list, backend: RayBackendConfig, what: str) -> list:
    """The answers of freshly started actors, or ActorStartupError naming `startup_timeout_s`
    (or the error an actor raised while starting)."""
    import ray

    try:
        return ray.get(refs, timeout=backend.startup_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ActorStartupError(
            f"{what}: not all actors started within ray startup_timeout_s="
            f"{backend.startup_timeout_s:g} s (importing, loading weights, building the engine); "
            "allowed: a larger startup_timeout_s on a slow or loaded host") from None
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
        raise ActorStartupError(f"{what}: an actor failed while starting: {e}") from None

PoolFactory = Callable[[int | None], KVPool]  # capacity_bytes -> a pool every actor can use


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
    draft: Any = None  # DraftSpec of the draft service (grouped speculation), or None


class RayInstanceGroup:
    """The actors of one rollout deployment: their proxies, the KV pool, weight sync,
    replacement of lost actors (the driver's `Replacer`), shutdown."""

    def __init__(self, instances: list[RayInstance], pool: KVPool, placement_group: Any,
                 pool_capacity_bytes: int | None = None, spec: ActorSpec | None = None,
                 replace_lost: bool = False, pool_factory: PoolFactory | None = None,
                 allow_fewer_slices: bool = False):
        """allow_fewer_slices: `reset()` goes on with the live slices once some were lost
        (False: it refuses, so a deployment does not shrink without a word)."""
        self.instances = instances
        self.num_slices = len(instances)  # as configured
        self.allow_fewer_slices = allow_fewer_slices
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
        self.draft: Any = None  # RayDraftService when the engines speculate

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

    def live_slices(self) -> int:
        return sum(not i.lost for i in self.instances) + len(self._pending)

    def reset(self) -> None:
        """Fresh engines and a fresh KV pool (zeroed counters) on every live actor, between
        independent rollouts; lost actors are dropped and the live ones numbered 0..N-1. With
        fewer live slices than configured it raises SeerError unless `allow_fewer_slices`
        (then it logs a warning)."""
        import ray

        from seer_jax.rollout.backends.ray_pool import RayKVPool

        self._join_all()
        live = [i for i in self.instances if not i.lost]
        if len(live) < self.num_slices:
            msg = (f"{len(live)} of the {self.num_slices} configured Ray slices are live "
                   f"({self.num_slices - len(live)} lost)")
            if not self.allow_fewer_slices:
                raise SeerError(f"{msg}; the next rollout would run on fewer slices; allowed: "
                                "allow_fewer_slices=True to go on with them, or start a new "
                                "group (make_ray_instances)")
            log.warning("%s; going on with them (allow_fewer_slices=True)", msg)
        make = self.pool_factory or RayKVPool.create
        old, self.pool = self.pool, make(self.pool_capacity_bytes)
        if self.draft is not None:  # empty shards before the fresh engines push to them
            self.draft.reset()
        refs = [[a.reset.remote(self.pool, k) for a in i.actors] for k, i in enumerate(live)]
        for k, (inst, snaps) in enumerate(zip(live, refs, strict=True)):
            inst.instance_id, inst.snap, inst.pool = k, ray.get(snaps)[0], self.pool  # the leader's
            inst.forget_steps()  # steps a failed rollout left queued ran before the reset
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
        timeout = self.spec.backend.startup_timeout_s if self.spec else PLACEMENT_TIMEOUT_S
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
                inst = proxy(self.spec.backend, iid, [actor], snap, self.pool, bundle)
                inst.draft = self.draft
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

    def draft_stats(self) -> dict | None:
        """The draft service's counters and its replicas' (from the last step snapshots)."""
        if self.draft is None:
            return None
        return self.draft.stats([i.snap for i in self.instances])

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
        if self.draft is not None:
            self.draft.shutdown()
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
    # pings are served by a thread of their own, also while a step runs; the default group
    # keeps one thread, so every other call still runs in the order it was sent
    actor_class = ray.remote(concurrency_groups={LIVENESS_GROUP: 1})(EngineActor)
    return actor_class.options(**opts).remote(
        instance_id, spec.cfg, spec.weights, spec.dtype, spec.engine_config, spec.tp, pool,
        spec.eos_ids, spec.record_steps, params_version, host, backend.hosts_per_slice,
        spec.draft)


def make_ray_instances(cfg: ModelConfig, weights: Weights, *, num_instances: int, tp: int,
                       engine_config: EngineConfig, backend: RayBackendConfig | None = None,
                       dtype: str = "float32", eos_ids: Sequence[int] | None = None,
                       pool_capacity_bytes: int | None = None,
                       record_steps: bool = False, replace_lost: bool = False,
                       pool_factory: PoolFactory | None = None,
                       draft_service: SyncConfig | None = None,
                       spec_budget: Callable[[], Any] | None = None,
                       fault_kill_draft_service_after_chunks: int = -1,
                       allow_fewer_slices: bool = False) -> RayInstanceGroup:
    """Start the engine actors, one per slice host (`backend.hosts_per_slice` per slice; the
    placement group has one bundle per host), sharing a KV pool: `pool_factory(capacity_bytes)`
    (called once Ray is up, and again by `reset()`), by default the object-store `RayKVPool`.
    weights: a params tree (sent as numpy arrays, one object-store copy) or a model name/path
    each actor loads itself. replace_lost: start a replacement for every actor lost during a
    rollout (the group is then `rollout`'s replacer); single-host slices only.
    With engine_config.speculation the group starts the draft service (`ray_draft_service`;
    draft_service: its shards and sync, default one shard, one step stale) and each actor
    drafts from its replica; spec_budget() builds each actor's speculation budget (None: the
    cost-model default); fault_kill_draft_service_after_chunks >= 0 kills the shard of the
    first group once that many chunks have ended.
    allow_fewer_slices: see `RayInstanceGroup`. Starting the actors may take up to
    `backend.startup_timeout_s` (ActorStartupError naming it otherwise)."""
    from seer_jax.rollout.backends.ray_pool import RayKVPool

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
    draft = None
    if engine_config.speculation:
        from seer_jax.rollout.backends.ray_draft_service import RayDraftService

        draft = RayDraftService(draft_service or SyncConfig(), spec_budget,
                                fault_after_chunks=fault_kill_draft_service_after_chunks)
    spec = ActorSpec(cfg=cfg, weights=weights if isinstance(weights, str) else ray.put(numpy_params(weights)),
                     dtype=dtype, engine_config=engine_config, tp=tp,
                     eos_ids=tuple(eos_ids) if eos_ids is not None else None,
                     record_steps=record_steps, backend=backend,
                     draft=draft.spec if draft is not None else None)
    slices = [[_start_actor(spec, pg, i * hosts + h, i, pool, 0, h) for h in range(hosts)]
              for i in range(num_instances)]
    try:
        what = f"starting {num_instances} slice(s) of {hosts} actor(s)"
        if hosts > 1:  # every host of a slice joins its leader's jax.distributed cluster at once
            leaders = await_startup([actors[0].coordinator.remote() for actors in slices],
                                    backend, what)
            timeout = int(backend.startup_timeout_s)
            await_startup([a.join.remote(addr, timeout, backend.coordinator_bind_address)
                           for addr, actors in zip(leaders, slices, strict=True) for a in actors],
                          backend, what)
        snaps = await_startup([actors[0].snapshot.remote() for actors in slices], backend, what)
    except BaseException:
        for a in (a for actors in slices for a in actors):
            ray.kill(a, no_restart=True)
        if hasattr(pool, "shutdown"):
            pool.shutdown()
        ray.util.remove_placement_group(pg)
        raise
    instances = [proxy(backend, i, actors, s, pool, i * hosts)
                 for i, (actors, s) in enumerate(zip(slices, snaps, strict=True))]
    group = RayInstanceGroup(instances, pool, pg, pool_capacity_bytes, spec, replace_lost,
                             pool_factory, allow_fewer_slices)
    if draft is not None:
        group.draft = draft
        draft.instances = lambda: group.instances
        for inst in instances:
            inst.draft = draft
    return group
