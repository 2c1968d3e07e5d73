"""`RayInstance`: the controller-side proxy of one slice's actor(s); implements `Instance`.

It keeps a snapshot of the actor's state (clock, work, KV load, which groups' prompts are cached,
in-flight progress) returned by every step, so the controller's placement questions cost no
round trip; `submit`, `abort` and `set_now` are sent without waiting (an actor runs its calls in
order, so they land before its next step). Steps can be started on every instance at once
(`start_step`) and collected afterwards (`finish_step`): what `ConcurrentDriver` does.

Slow is not dead. While a step runs the proxy pings the actor (`EngineActor.ping`, served by its
own Ray concurrency group, so it is answered mid-step). An actor that dies, does not answer a
ping within `liveness_timeout_s` (silent), or whose step runs past its limit (the larger of
`step_timeout_s` and `step_timeout_factor` times the longest step it has run, its first,
compiling step included) is lost: `InstanceLostError`, and it is killed so a hung process does
not linger. A loaded host slows every step, so the limit grows with them. An exception raised
by the engine inside the actor is not a loss: it fails the rollout (`InstanceFailedError`, with
the actor's traceback).

Multi-host slices: every state-changing call (submit, abort, set_now, step, fault injection,
kill) goes to all H actors in the same order, so their host-side schedulers stay identical and
their device steps run as one SPMD program. The proxy answers from the leader's results and
checks the followers' digests against them. A KV handle is resolved once by the proxy so that
every host imports the same blob (or none). A host that dies, raises or hangs loses the whole
slice.

Lost actors: the proxy kills every actor of a lost slice and tells the KV pool (`writer_lost`,
with the leader's actor id) to drop the blobs it wrote: they died with it, and their requests
re-prefill.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import Any

from seer_jax.errors import SeerError
from seer_jax.rollout.backends.ray_actor import LIVENESS_GROUP, ActorSnapshot, report_digest
from seer_jax.rollout.core.instance import InstanceFailedError, InstanceLostError
from seer_jax.rollout.core.types import ChunkRequest, InstanceLoad, StepReport


class RayInstance:
    """Controller-side proxy of one slice: one `EngineActor`, or the actors of a multi-host
    slice (leader first); implements `Instance`."""

    def __init__(self, instance_id: int, actor: Any, snapshot: ActorSnapshot, step_timeout_s: float,
                 followers: Sequence[Any] = (), pool: Any = None, bundle_index: int = 0,
                 pipeline_depth: int = 1, step_timeout_factor: float = 10.0,
                 liveness_interval_s: float = 5.0, liveness_timeout_s: float = 60.0):
        """followers: the other hosts' actors of a multi-host slice; pool: the KV pool (its
        handles are resolved here for a multi-host slice, and it is told when the slice is lost,
        so the KV its leader wrote is dropped); bundle_index: the leader's placement-group
        bundle; pipeline_depth: how many steps `ConcurrentDriver` keeps queued on the actor;
        step_timeout_s, step_timeout_factor, liveness_*: see `RayBackendConfig`."""
        self.instance_id = instance_id
        self.actor = actor
        self.actors = [actor, *followers]
        self.pool = pool
        self.snap = snapshot
        self.step_timeout_s = step_timeout_s
        self.step_timeout_factor = step_timeout_factor
        self.liveness_interval_s = liveness_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.bundle_index = bundle_index  # its placement-group bundle
        self.lost = False
        self.killed = False  # `kill` was called (the actors may still answer for a moment)
        self._submits: list = []  # refs of submits sent since the last step was started
        # steps started and not finished: (step refs, refs of the submits sent before it)
        self._started: collections.deque = collections.deque()
        self.pipeline_depth = pipeline_depth
        self.draft: Any = None  # the RayDraftService (grouped speculation), told of chunks and steps

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
        if self.draft is not None:
            self.draft.on_submit(chunk)
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

    def close_group(self, group_id: str) -> None:
        """Every request of the group has finished: the actors and the draft service forget
        it."""
        if self.lost:
            return
        for a in self.actors:
            a.close_group.remote(group_id)
        if self.draft is not None:
            self.draft.close_group(group_id)

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
        (rep, snap), *followers = self._await_step(refs)
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
        if self.draft is not None:
            self.draft.on_step(rep, snap)
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

    def forget_steps(self) -> None:
        """Drop the refs of steps and submits never collected (a rollout that failed)."""
        self._started.clear()
        self._submits = []

    def kill(self) -> None:
        import ray

        self.killed = True
        for a in self.actors:
            ray.kill(a, no_restart=True)

    def _get(self, refs: list, timeout_s: float) -> list:
        """Every host's answer to a short call (not a step), or InstanceLostError (and the slice
        killed) as soon as one host dies, or when not all answered within timeout_s; a call
        that raised is an `InstanceFailedError`."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1,
                                          timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    self._lose(f"no answer within {timeout_s:g} s")
                ray.get(ready)  # raises at once when that host died or raised
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            self._lose(f"actor died ({type(e).__name__})")
        except ray.exceptions.RayTaskError as e:
            raise self._failed(e) from e.cause

    def _await_step(self, refs: list) -> list:
        """Every host's answer to a step. While none comes back the actors are pinged (they
        answer from their liveness thread, also mid-step): a host that does not answer within
        `liveness_timeout_s` is silent, and one whose step has run past `step_limit` hangs;
        either loses the slice, as does a host that dies. A step that raised fails the rollout
        (`InstanceFailedError`): a bug is not a lost machine."""
        import ray

        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1,
                                          timeout=self.liveness_interval_s)
                if ready:
                    ray.get(ready)  # raises at once when that host died or raised
                    continue
                self._check_liveness([self.actors[refs.index(r)] for r in pending])
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            self._lose(f"actor died ({type(e).__name__})")
        except ray.exceptions.RayTaskError as e:
            raise self._failed(e) from e.cause

    def step_limit(self, longest_step_s: float) -> float:
        """How long a step may run on an actor whose longest step so far took longest_step_s."""
        return max(self.step_timeout_s, self.step_timeout_factor * longest_step_s)

    def _check_liveness(self, actors: list) -> None:
        import ray

        pings = [a.ping.options(concurrency_group=LIVENESS_GROUP).remote() for a in actors]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=self.liveness_timeout_s)
        for ref, actor in zip(pings, actors, strict=True):
            host = self.actors.index(actor)
            where = f"host {host} " if len(self.actors) > 1 else ""
            if ref not in answered:
                self._lose(f"silent: {where}did not answer a liveness ping within "
                           f"{self.liveness_timeout_s:g} s (liveness_timeout_s)")
            live = ray.get(ref)  # RayActorError when it died meanwhile
            if live.running_s is not None and live.running_s > self.step_limit(live.longest_step_s):
                self._lose(
                    f"{where}step running for {live.running_s:.0f} s, past its limit "
                    f"{self.step_limit(live.longest_step_s):.0f} s (the larger of step_timeout_s="
                    f"{self.step_timeout_s:g} and step_timeout_factor={self.step_timeout_factor:g}"
                    f" x its longest step, {live.longest_step_s:.1f} s)")

    def _failed(self, e: Any) -> InstanceFailedError:
        """The error a host raised, with its traceback from the actor's process."""
        cause = e.cause if getattr(e, "cause", None) is not None else e
        trace = getattr(e, "traceback_str", "") or str(e)
        return InstanceFailedError(
            f"instance {self.instance_id} raised {type(cause).__name__}: {cause}\n"
            f"--- traceback in the actor (pid {getattr(e, 'pid', '?')}) ---\n{trace}")

    def _lose(self, why: str) -> None:
        self.lost = True
        self._started.clear()
        self.kill()
        if hasattr(self.pool, "writer_lost"):  # its KV blobs died with it (the leader wrote them)
            self.pool.writer_lost(self.actor._actor_id.hex())
        raise InstanceLostError(f"instance {self.instance_id} lost: {why}")
