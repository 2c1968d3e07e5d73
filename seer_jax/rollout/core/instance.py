"""The instance interface: the only view the controller and policies have of an inference instance.

Three worlds implement it: a real engine on a mesh slice (`rollout.backends.engine_instance`), a
simulated instance with a cost model (`sim.instance`), and a Ray actor wrapping a real engine
(`rollout.backends.ray_proxy`).
Time is never read from the wall clock here: each instance owns a clock (`now()`), advanced by its
steps: real measured durations, or modelled ones.

KV residency: when a chunk ends unfinished the instance writes the request's KV to the global
pool (`KVPool.put`) and may keep its pages resident as an evictable cache, so the next chunk on
the same instance needs no import (`resident_tokens` tells placement how much is cached there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from seer_jax.errors import SeerError
from seer_jax.rollout.core.types import ChunkRequest, InstanceLoad, StepReport


@runtime_checkable
class Instance(Protocol):
    instance_id: int

    def now(self) -> float:
        """Current time on this instance's clock (seconds)."""

    def set_now(self, t: float) -> None:
        """Move an idle instance's clock forward to t (the driver does this when it hands work to
        an instance whose clock is behind the controller's)."""

    def submit(self, chunk: ChunkRequest) -> None:
        """Queue a chunk. Raises SeerError for a chunk the instance can never run."""

    def has_work(self) -> bool:
        """True while any submitted chunk is unfinished."""

    def step(self) -> StepReport:
        """Run one engine iteration, advance the clock by its duration, report ended chunks."""

    def load(self) -> InstanceLoad:
        """Running/waiting chunks and KV pages."""

    def resident_tokens(self, request_id: str, group_id: str) -> int:
        """Tokens of this request's context (or its group's shared prompt) whose KV is resident
        here: the affinity signal."""

    def abort(self, request_id: str) -> None:
        """Drop a queued or running chunk (its request is re-dispatched elsewhere)."""

    def running_progress(self) -> Mapping[str, int]:
        """Tokens generated so far by each request whose chunk is running here (earlier chunks
        included). Seer instances stream tokens to the group draft server as they generate, so
        the scheduler knows how far in-flight requests have got; the controller reads this only
        when a policy asks (`Policy.wants_progress`). Optional: instances without it report
        nothing about in-flight chunks."""


class KVPool(Protocol):
    """The global KV pool: unfinished requests' KV between chunks. Host memory in-process by
    default (`HostKVPool`); across hosts Ray's object store (`RayKVPool`) or Mooncake Store
    (`MooncakeKVPool`). Blobs are opaque to the pool."""

    def put(self, request_id: str, blob: object, nbytes: int) -> str:
        """Store a request's KV (replacing an older version); returns a handle."""

    def get(self, handle: str) -> object | None:
        """The blob, or None when it was evicted (caller falls back to re-prefill)."""

    def delete(self, request_id: str) -> None:
        """Forget a finished request's KV."""


class InstanceLostError(SeerError):
    """An instance is gone (crashed, preempted, unreachable, silent); raised by `step()`/
    `submit()`. The controller re-dispatches its chunks."""


class InstanceFailedError(SeerError):
    """Engine or model code raised inside a live instance (a bug, not a lost machine): the
    rollout fails with it. The message carries the instance's own traceback; `__cause__` is the
    original exception when the backend can rebuild it."""
