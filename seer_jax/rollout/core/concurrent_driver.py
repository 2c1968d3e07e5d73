"""Wall-clock driver that keeps every instance busy at once, and fault injection.

`ConcurrentDriver` runs in rounds: every live instance with work starts a step at the same time
(Ray actors: the step call is sent to each actor; other instances, e.g. in-process engines on
their own mesh slices: one thread each, JAX releasing the GIL while it executes); the driver waits
for all of them, then hands the ended chunks to the controller in instance order, marks lost
instances, and dispatches once. The controller stays on this thread and sees the same sequence
of events whatever the steps' timing, so what it decides (placement, chunk sizes, order) is
deterministic; only the reported times come from the wall clock.

Pipelined steps: an instance with `start_step` and `pipeline_depth` = D > 1 (a Ray actor, see
`RayBackendConfig.pipeline_depth`) keeps up to D steps queued, so it starts its next step while
the driver is still reading the last one's results and dispatching: the round trip and the
controller's work are hidden behind the device step. Chunks dispatched in a round are sent
behind the steps already queued and so start D - 1 steps later than without pipelining. What the
controller sees still depends only on the order of the driver's calls, never on timing. Once the
rollout is done the queued steps (they find no work) are collected.

A round lasts as long as its slowest step. Instances whose steps take very different times would
do better with a driver that delivers each instance's results as they arrive (at the cost of
decisions that depend on timing); that is not built.

Faults: an instance whose step raises `InstanceLostError` (a Ray actor that died, raised, or hung
past its timeout) is marked lost and its chunks go back to the controller's buffer. `FaultPlan`
injects one on instance `instance` once `after_chunks` chunks have ended anywhere, at a moment
given by `when`:

- "chunks": killed at once (a Ray actor's process is killed, and the driver confirms it is gone;
  an in-process instance is marked lost);
- "kv_put": killed right after a round in which it put a request's KV into the pool (a chunk of
  it ended unfinished there), so the next chunk of that request reads a blob whose writer is
  dead (on Ray: gone with it, the request re-prefills);
- "kv_load": armed to die while it imports KV written by another instance (its process exits
  after fetching the blob, before installing it); the chunk runs elsewhere from the same blob.
  Needs an instance with `inject_fault` (a Ray actor).

Replacement: with a `replacer` (`RayInstanceGroup` when `ray_replace_lost` is on), every lost
instance is replaced: the replacer starts a new instance while the rollout goes on, and once it
is up the driver registers it with the controller under the next instance id
(`Controller.add_instance`), so later chunks can run on it.
Controller restart is not covered: the controller holds the rollout's state in memory.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from seer_jax.errors import ConfigError, SeerError
from seer_jax.rollout.core.driver import InstanceTimeline, _DriverBase
from seer_jax.rollout.core.instance import Instance, InstanceLostError
from seer_jax.rollout.core.types import StepReport

if TYPE_CHECKING:
    from seer_jax.rollout.core.controller import Controller


FAULT_WHEN = ("chunks", "kv_put", "kv_load")
log = logging.getLogger(__name__)


@dataclasses.dataclass
class FaultPlan:
    """Kill instance `instance` once `after_chunks` chunks have ended (anywhere), at the moment
    `when` names (see the module docstring)."""

    instance: int
    after_chunks: int
    when: str = "chunks"
    fired_at: float | None = None  # driver time of the kill (of the arming, for "kv_load")
    detect_s: float | None = None  # kill until the driver saw the instance gone

    def validate(self, num_instances: int) -> FaultPlan:
        if not 0 <= self.instance < num_instances:
            raise ConfigError(f"fault_kill_instance={self.instance} is invalid; allowed: "
                              f"-1 (off) or 0..{num_instances - 1}")
        if self.after_chunks < 0:
            raise ConfigError(f"fault_after_chunks={self.after_chunks} is invalid; allowed: >= 0")
        if self.when not in FAULT_WHEN:
            raise ConfigError(f"fault_when={self.when!r} is invalid; allowed: {list(FAULT_WHEN)}")
        return self


class Replacer(Protocol):
    """Starts instances that replace lost ones (`RayInstanceGroup` implements it)."""

    def replace(self, lost_id: int) -> None:
        """Start a replacement for lost instance `lost_id` (returns at once)."""

    def pending_replacements(self) -> int:
        """Replacements started and not yet joined or failed."""

    def joined(self, next_id: int, wait: bool) -> list[tuple[int, Instance]]:
        """(lost id, replacement) for the replacements that are up, numbered from `next_id` on;
        with `wait`, block until at least one is up or every pending one has failed."""


class ConcurrentDriver(_DriverBase):
    """Real time; every instance with work steps at once; see the module docstring."""

    def __init__(self, controller: Controller, clock: Callable[[], float] | None = None,
                 fault: FaultPlan | None = None, replacer: Replacer | None = None):
        super().__init__(controller)
        self.clock = clock or time.perf_counter
        self.fault = fault.validate(len(controller.instances)) if fault else None
        if self.fault and self.fault.when == "kv_load" and not hasattr(
                controller.instances[self.fault.instance], "inject_fault"):
            raise ConfigError("fault_when='kv_load' is invalid for in-process instances; "
                              "allowed: backend='ray' (the actor's process exits mid-load)")
        self.replacer = replacer
        self.rounds = 0
        self.lost_reasons: dict[int, str] = {}  # instance -> why it was marked lost
        self.replaced: dict[int, int] = {}  # lost instance -> the instance that replaced it

    def run(self) -> None:
        ctl = self.ctl
        insts = ctl.instances
        origin = self.clock()
        ctl.instance_clock_origin = None
        self.alive = [True] * len(insts)
        # steps started and not yet collected, oldest first (more than one only for instances
        # with `pipeline_depth` > 1)
        self.inflight: list[collections.deque] = [collections.deque() for _ in insts]
        threads = concurrent.futures.ThreadPoolExecutor(max_workers=len(insts),
                                                        thread_name_prefix="seer-step")
        try:
            ctl.start(0.0)
            ctl.dispatch(0.0)
            self._maybe_fault(0.0)
            while not ctl.done:
                for i, inst in enumerate(insts):
                    depth = getattr(inst, "pipeline_depth", 1) if hasattr(inst, "start_step") else 1
                    while self.alive[i] and len(self.inflight[i]) < depth and inst.has_work():
                        self.inflight[i].append(self._start(inst, threads))
                busy = [i for i in range(len(insts)) if self.inflight[i]]
                if not busy:
                    if ctl.dispatch(self.clock() - origin) == 0:
                        if not self._adopt(wait=True):
                            raise self._stalled()
                    continue
                reports: dict[int, StepReport] = {}
                lost: list[int] = []
                for i in busy:
                    try:
                        reports[i] = self._finish(insts[i], self.inflight[i].popleft())
                    except InstanceLostError as e:
                        self.lost_reasons.setdefault(i, str(e))
                        log.warning("%s; its chunks go back to the buffer", e)
                        lost.append(i)
                now = self.clock() - origin
                self.rounds += 1
                for i, rep in reports.items():
                    self.timelines[i].record(rep, now)
                    for res in rep.finished:
                        ctl.on_chunk_result(res, now)
                for i in lost:
                    self._lose(i, now)
                self._maybe_fault(now, reports)
                self._adopt(wait=not any(self.alive))
                ctl.dispatch(now)
            self._drain()
        finally:
            threads.shutdown(wait=True)
        self.end_time = self.clock() - origin

    def _drain(self) -> None:
        """Collect the steps still in flight once every request is done: they ran with no chunk
        left (a pipelined step started before the last results arrived)."""
        for i, pending in enumerate(self.inflight):
            while pending:
                try:
                    rep = self._finish(self.ctl.instances[i], pending.popleft())
                except InstanceLostError as e:  # gone after the rollout ended: nothing to redo
                    self.lost_reasons.setdefault(i, str(e))
                    pending.clear()
                    continue
                if rep.finished:
                    raise SeerError(f"instance {i} ended {len(rep.finished)} chunk(s) after every "
                                    "request was done")

    def _start(self, inst: Any, threads: concurrent.futures.ThreadPoolExecutor) -> Any:
        if hasattr(inst, "start_step"):
            try:
                return inst.start_step()
            except InstanceLostError as e:
                return e
        return threads.submit(inst.step)

    @staticmethod
    def _finish(inst: Any, started: Any) -> StepReport:
        if isinstance(started, InstanceLostError):
            raise started
        if isinstance(started, concurrent.futures.Future):
            return started.result()
        return inst.finish_step(started)

    def _lose(self, i: int, now: float) -> None:
        if not self.alive[i]:
            return
        self.alive[i] = False
        self.inflight[i].clear()  # abandoned: the instance's chunks go back to the controller
        self.timelines[i].lost_at = now
        self.ctl.on_instance_lost(i, now)
        if self.replacer is not None:
            self.replacer.replace(i)

    def _adopt(self, wait: bool) -> bool:
        """Register replacements that are up with the controller; True when any joined."""
        if self.replacer is None or not self.replacer.pending_replacements():
            return False
        joined = self.replacer.joined(len(self.ctl.instances), wait)
        for lost_id, inst in joined:
            self.ctl.add_instance(inst)
            self.alive.append(True)
            self.inflight.append(collections.deque())
            self.timelines.append(InstanceTimeline(inst.instance_id))
            self.replaced[lost_id] = inst.instance_id
        return bool(joined)

    def _maybe_fault(self, now: float, reports: dict[int, StepReport] | None = None) -> None:
        f = self.fault
        if f is None or f.fired_at is not None or self.ctl.stats.chunks < f.after_chunks:
            return
        inst = self.ctl.instances[f.instance]
        if f.when == "kv_load":
            f.fired_at = now
            self.lost_reasons[f.instance] = "killed by the fault plan while importing KV"
            inst.inject_fault("kill_on_kv_load")
            return
        if f.when == "kv_put":
            rep = (reports or {}).get(f.instance)
            if rep is None or not any(r.kv_handle is not None for r in rep.finished):
                return  # wait for a round in which it wrote KV to the pool
        f.fired_at = now
        self.lost_reasons[f.instance] = f"killed by the fault plan after {f.after_chunks} chunks"
        t0 = time.perf_counter()
        if hasattr(inst, "kill"):
            inst.kill()
            try:  # the process is gone: confirm it the way a real failure is found
                inst.check_alive()
            except InstanceLostError:
                pass
        f.detect_s = time.perf_counter() - t0
        self._lose(f.instance, now)
