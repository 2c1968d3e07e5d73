"""The engine actor of one mesh slice (or of one host of a multi-host slice): `EngineActor`.

One actor per slice owns an `EngineInstance` on the devices its process sees (on a dev box: `tp`
fake CPU devices set through the actor's environment before jax is imported). What reaches an
actor is plain data: the `ModelConfig` and `EngineConfig` dataclasses, and the weights either as
numpy arrays through the object store (put once, shared by every actor) or as a path the actor
loads itself. No model code is pickled: the actor imports it.

Multi-host slices (`RayBackendConfig.hosts_per_slice` = H > 1): a slice is H actors, one per
host bundle, that join one `jax.distributed` cluster (the leader, host 0, picks a free port on
its node; the others connect to it) and build the same engine over the global mesh of all their
devices. The followers return a digest of each step's report (`report_digest`), which the proxy
checks against the leader's. Only the leader writes KV to the pool (`_HostPool`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import SeerError
from seer_jax.model.config import ModelConfig
from seer_jax.rollout.backends.ray_cluster import coordinator_bind, pin_to_cpu_core
from seer_jax.rollout.core.instance import KVPool
from seer_jax.rollout.core.types import ChunkRequest, InstanceLoad, StepReport

ACTOR_FAULTS = ("raise", "hang", "slow", "kill_on_kv_load")
log = logging.getLogger(__name__)
LIVENESS_GROUP = "liveness"  # the actor's concurrency group for `ping` (its own thread)
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
    draft: dict | None = None  # the draft replica's stats and the shards it found down


@dataclasses.dataclass
class Liveness:
    """What an actor answers to a ping, also in the middle of a step."""

    pid: int
    steps: int  # steps finished
    running_s: float | None  # how long the step now running has run (None: none running)
    longest_step_s: float  # the longest finished step (the first one compiles)


def numpy_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A params tree as host numpy arrays (what goes into the object store)."""
    return {k: numpy_params(v) if isinstance(v, Mapping) else np.asarray(v)
            for k, v in params.items()}


class EngineActor:
    """The actor's class (wrapped with `ray.remote` by `make_ray_instances`)."""

    def __init__(self, instance_id: int, cfg: ModelConfig, weights: Weights, dtype: str,
                 engine_config: EngineConfig, tp: int, pool: KVPool,
                 eos_ids: tuple[int, ...] | None, record_steps: bool, params_version: int = 0,
                 host: int = 0, hosts: int = 1, draft: Any = None):
        """params_version: the version of `weights` (a replacement starts at the group's);
        host, hosts: this actor's place in a slice of `hosts` actors; with hosts > 1 nothing
        touches jax here (`jax.distributed` must start first): `join` builds the engine once
        every host of the slice has started. draft: the `DraftSpec` of the draft service
        (grouped speculation with engine_config.speculation; the leader drafts)."""
        pin_to_cpu_core()  # RayBackendConfig.pin_cpus, before XLA starts its thread pool
        if os.nice(0) > 0:
            log.warning("engine actor %d runs at nice %d: beside busy processes its steps slow "
                        "down; start the Ray cluster's nodes with RAY_worker_niceness=0",
                        instance_id, os.nice(0))
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
        self.fault_s = 0.0  # how long a "slow" step sleeps
        self.steps = 0
        self.longest_step_s = 0.0
        self._step_started: float | None = None  # time.monotonic() of the running step
        self.inst = None
        self.draft, self.replica = draft, None
        self.builds = 0  # engines built (every host of a slice counts the same)
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

    def join(self, coordinator: str, timeout_s: int = 300, bind_address: str = "") -> int:
        """Join the slice's `jax.distributed` cluster (every host of the slice at once) and build
        the engine over the global mesh of the slice's devices; returns the process index.
        bind_address: where the leader's coordinator listens (`coordinator_bind`: "" = the
        coordinator's own address)."""
        import jax

        # the leader's coordinator listens on its cluster address only (JAX's default binds
        # every interface, [::]); the coordinator has no authentication
        bind = coordinator_bind(coordinator, bind_address) if self.host == 0 else None
        if os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=self.hosts,
                                   process_id=self.host, initialization_timeout=timeout_s,
                                   coordinator_bind_address=bind)
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
        from seer_jax.rollout.backends.engine_instance import EngineInstance

        mesh = Mesh(np.array(self.devices), ("tp",))
        speculator, self.replica = None, None
        self.builds += 1
        if self.draft is not None and self.engine_config.speculation:
            speculator, self.replica = self._speculator()
        engine = Engine(self.cfg, self.params, self.engine_config, mesh=mesh, eos_ids=self.eos_ids,
                        speculator=speculator)
        self.inst = EngineInstance(self.instance_id, engine, self.pool,
                                   record_steps=self.record_steps)
        self.ran: set[str] = set()  # requests that had a chunk submitted here

    def _speculator(self):
        """(Speculator, replica or None): the leader drafts from its replica of the draft
        service; the other hosts of a slice take the leader's drafts (`slice_drafts`)."""
        if self.hosts == 1:
            return self.draft.make_speculator()
        from seer_jax.rollout.backends.slice_drafts import slice_speculator

        return slice_speculator(self.draft, self.builds, self.host)

    def set_draft_shard(self, k: int, handle: Any) -> None:
        """Draft-service shard k was rebuilt: this is its new actor."""
        from seer_jax.rollout.backends.ray_draft_service import RayShardLink

        self.draft.shards[k] = handle
        if self.replica is not None:
            self.replica.replace_shard(k, RayShardLink(handle))

    def clear_drafts(self, epoch: int | None = None) -> None:
        """Forget the draft contexts of the last rollout (its groups are over); with `epoch`,
        this replica and the next engine's push and pull in that rollout epoch."""
        if epoch is not None:
            self.draft = dataclasses.replace(self.draft, epoch=epoch)
        if self.replica is not None:
            self.replica.clear(epoch)

    def close_group(self, group_id: str) -> None:
        """Every request of the group has finished: the instance and its speculator (whose
        service is this actor's replica) forget it."""
        if self.inst is not None:
            self.inst.close_group(group_id)

    def set_draft_sync(self, sync: Any) -> None:
        """How the next engine's replica syncs (a `SyncConfig`; from the next `reset`)."""
        self.draft = dataclasses.replace(self.draft, sync=sync)

    def snapshot(self) -> ActorSnapshot:
        inst = self.inst
        return ActorSnapshot(
            now=inst.now(), has_work=inst.has_work(), load=inst.load(),
            resident={g: n for g in inst._prompts if (n := inst.resident_tokens("", g))},
            progress=inst.running_progress(), params_version=self.params_version,
            pid=os.getpid(), draft=self.replica.status() if self.replica is not None else None)

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
        if self.replica is not None:
            self.replica.start_request(chunk.group_id, chunk.request_id, chunk.prompt_ids,
                                       chunk.output_ids)
        self.inst.submit(chunk)

    def set_now(self, t: float) -> None:
        self.inst.set_now(t)

    def abort(self, request_id: str) -> None:
        self.inst.abort(request_id)
        if self.replica is not None:
            self.replica.abort(request_id)

    def ping(self) -> Liveness:
        """Answered from the liveness concurrency group's thread, while a step runs too."""
        started = self._step_started
        return Liveness(pid=os.getpid(), steps=self.steps,
                        running_s=None if started is None else time.monotonic() - started,
                        longest_step_s=self.longest_step_s)

    def step(self) -> tuple[StepReport, ActorSnapshot] | tuple[tuple, None]:
        """The leader's report and snapshot; a follower returns the digest of its report."""
        t0 = self._step_started = time.monotonic()
        try:
            if self.fault == "raise":
                raise SeerError(f"injected fault on instance {self.instance_id}")
            if self.fault == "hang":
                time.sleep(3600)
            if self.fault == "slow":
                self.fault = None
                time.sleep(self.fault_s)
            if self.replica is not None:
                self.replica.before_step()
            rep = self.inst.step()
            if self.replica is not None:
                self.replica.after_step()
        finally:
            self._step_started = None
        self.steps += 1
        self.longest_step_s = max(self.longest_step_s, time.monotonic() - t0)
        if self.host > 0:
            return report_digest(rep), None
        return rep, self.snapshot()

    def inject_fault(self, kind: str | None, seconds: float = 0.0) -> None:
        """Fault injection for tests and demos: every later step raises from inside the step
        ("raise", as a bug in engine code would) or hangs while the actor still answers pings
        ("hang"); the next step sleeps `seconds` before it runs ("slow"); or the process exits
        while importing KV that another actor wrote ("kill_on_kv_load"); None disarms."""
        if kind is not None and kind not in ACTOR_FAULTS:
            raise SeerError(f"fault {kind!r} is unknown; allowed: {list(ACTOR_FAULTS)}")
        self.fault, self.fault_s = kind, seconds

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
