"""Drivers: the clock worlds that step instances and feed the controller.

The controller never reads a clock; a driver owns time:

- `EmulatedClusterDriver`: N instances (real engines on one host, or simulated ones), each on its
  own virtual clock advanced by its steps' durations (measured or modelled). Discrete-event loop:
  always step the instance with the smallest clock that has work; the chunks it finished are
  events at its new clock; an event is delivered to the controller (then the controller
  dispatches) once no busy instance's clock is behind it, so the controller sees the cluster in
  time order. An idle instance given work at time t is moved forward to t (`set_now`).
  This is how one 2-core machine reports what N accelerators would do.
- `WallClockDriver`: real time from an injected `clock` (default `time.perf_counter`); steps the
  instances with work in turn and delivers their chunks at the current time.
- `ConcurrentDriver` (`rollout.concurrent_driver`): real time, every instance stepping at once
  (Ray actors, or threads for in-process slices), results delivered in rounds.

Both record per-instance busy time (sum of step durations), step counts and the last time each
instance was busy, for the report. Times given to the controller are seconds since `run()` began.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from seer_jax.errors import ConfigError, SeerError
from seer_jax.rollout.core.instance import InstanceLostError
from seer_jax.rollout.core.types import ChunkResult

if TYPE_CHECKING:
    from seer_jax.rollout.core.controller import Controller


@dataclasses.dataclass
class InstanceTimeline:
    instance_id: int
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    chunks: int = 0  # chunks that ended here
    last_busy_at: float = 0.0
    lost_at: float | None = None

    def record(self, rep, now: float) -> None:
        """A step of this instance (a StepReport) ended at driver time `now`."""
        self.busy_s += rep.duration_s
        self.steps += 1
        self.tokens += rep.num_tokens
        self.chunks += len(rep.finished)
        self.last_busy_at = now


class _DriverBase:
    def __init__(self, controller: Controller):
        self.ctl = controller
        self.timelines = [InstanceTimeline(i) for i in range(len(controller.instances))]
        self.start_time = 0.0
        self.end_time = 0.0

    @property
    def elapsed_s(self) -> float:
        return self.end_time - self.start_time

    def _stalled(self) -> SeerError:
        left = self.ctl.num_requests - self.ctl.num_done
        return SeerError(
            f"rollout stalled: {left} requests unfinished, no instance has work and none could be "
            "placed (check instance KV capacity against prompt + max_tokens)"
        )


class EmulatedClusterDriver(_DriverBase):
    """Per-instance virtual clocks; see the module docstring."""

    def run(self) -> None:
        ctl = self.ctl
        insts = ctl.instances
        self.start_time = 0.0
        t0 = min(inst.now() for inst in insts)
        for inst in insts:
            inst.set_now(t0)
        origin = t0
        ctl.instance_clock_origin = origin
        alive = [True] * len(insts)
        pending: list[tuple[float, int, int, list[ChunkResult]]] = []  # (time, seq, iid, results)
        seq = 0
        ctl.start(0.0)
        ctl.dispatch(0.0)
        inf = float("inf")
        # (clock, index) of each busy instance, None for an idle or lost one. A step changes
        # only its own instance's entry; a controller call (results, dispatch, a loss) may
        # submit anywhere, so every entry is read again after one.
        probes = [(inst.now, inst.has_work) for inst in insts]
        keys: list[tuple[float, int] | None] = [None] * len(insts)

        def probe(k: int) -> None:
            now, has_work = probes[k]
            keys[k] = (now(), k) if alive[k] and has_work() else None

        stale = True
        while not ctl.done:
            if stale:
                for k in range(len(insts)):
                    probe(k)
                stale = False
            # the earliest busy instance: (its clock, its index), the lowest index on a tie
            t_step, i = min([key for key in keys if key is not None], default=(inf, -1))
            t_event = pending[0][0] if pending else float("inf")
            if t_event == float("inf") and t_step == float("inf"):
                stale = True
                if ctl.dispatch(self.end_time) == 0:
                    raise self._stalled()
                continue
            if t_event <= t_step:
                stale = True
                now = t_event
                while pending and pending[0][0] == now:
                    _, _, iid, results = heapq.heappop(pending)
                    if not alive[iid]:
                        continue
                    for res in results:
                        ctl.on_chunk_result(res, now - origin)
                ctl.dispatch(now - origin)
                self.end_time = max(self.end_time, now - origin)
                continue
            inst = insts[i]
            try:
                rep = inst.step()
            except InstanceLostError:
                stale = True
                alive[i] = False
                now = inst.now()
                self.timelines[i].lost_at = now - origin
                ctl.on_instance_lost(i, now - origin)
                ctl.dispatch(now - origin)
                continue
            probe(i)
            t_end = inst.now()
            self.timelines[i].record(rep, t_end - origin)
            self.end_time = max(self.end_time, t_end - origin)
            if rep.finished:
                seq += 1
                heapq.heappush(pending, (t_end, seq, i, rep.finished))
            # a lost flag set without raising
            if getattr(inst, "lost", False) and alive[i]:
                stale = True
                alive[i] = False
                self.timelines[i].lost_at = t_end - origin
                ctl.on_instance_lost(i, t_end - origin)
        self.end_time = max(
            [self.end_time] + [r.finished_at for r in ctl.requests.values() if r.finished_at]
        )


class WallClockDriver(_DriverBase):
    """Real time: instances stepped in turn on this thread; results delivered immediately."""

    def __init__(self, controller: Controller, clock: Callable[[], float] | None = None):
        super().__init__(controller)
        self.clock = clock or time.perf_counter

    def run(self) -> None:
        ctl = self.ctl
        insts = ctl.instances
        origin = self.clock()
        ctl.instance_clock_origin = None
        alive = [True] * len(insts)
        ctl.start(0.0)
        ctl.dispatch(0.0)
        while not ctl.done:
            stepped = False
            for i, inst in enumerate(insts):
                if not alive[i] or not inst.has_work():
                    continue
                stepped = True
                try:
                    rep = inst.step()
                except InstanceLostError:
                    alive[i] = False
                    now = self.clock() - origin
                    self.timelines[i].lost_at = now
                    ctl.on_instance_lost(i, now)
                    ctl.dispatch(now)
                    continue
                now = self.clock() - origin
                self.timelines[i].record(rep, now)
                for res in rep.finished:
                    ctl.on_chunk_result(res, now)
                ctl.dispatch(now)
            if not stepped and not ctl.done and ctl.dispatch(self.clock() - origin) == 0:
                raise self._stalled()
        self.end_time = self.clock() - origin


CLOCKS = ("emulated", "wall", "concurrent")  # "concurrent": `rollout.concurrent_driver`


def make_driver(
    clock: str, controller: Controller, wall_clock: Callable[[], float] | None = None
) -> EmulatedClusterDriver | WallClockDriver:
    if clock == "emulated":
        return EmulatedClusterDriver(controller)
    if clock == "wall":
        return WallClockDriver(controller, wall_clock)
    raise ConfigError(f"clock={clock!r} is unknown; allowed: {list(CLOCKS)}")
