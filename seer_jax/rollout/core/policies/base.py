"""Scheduling-policy interface and the request/group state the controller shares with policies.

A policy orders the *request buffer*: requests waiting for their next chunk (a new request, or one
whose previous chunk ended unfinished). The controller pushes a request when it enters the buffer,
pops the policy's next choice when an instance has room, and pushes it back (`requeue=True`) when
placement found no room for it this round. A policy is told when a request finishes (its length
is then known), which is what context-aware policies learn from.

Class attributes tell the controller how to run a policy:
- `divided`: requests are cut into chunks of `chunk_size` tokens and may run on any instance
  (False: each request runs to completion in one chunk on its group's pinned instance);
- `kv_admission`: the controller admits chunks to an instance only while its KV budget covers
  them, so nothing is preempted (False: everything is submitted at once and the instance's own
  scheduler overcommits and preempts, like veRL + vLLM).

Heaps with lazy invalidation: each push stamps the request with a fresh `buffer_token`; a heap
entry is live while the request is in the buffer with that token (and, for keys that can change,
while the key's version is current).
"""

from __future__ import annotations

import abc
import dataclasses
import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from seer_jax.errors import ConfigError
from seer_jax.rollout.core.types import FinishReason, SamplingParams


@dataclasses.dataclass(eq=False)
class GroupState:
    group_id: str
    index: int
    max_tokens: int
    requests: list[RequestState] = dataclasses.field(default_factory=list)
    num_finished: int = 0
    finished_max_len: int | None = None  # max output length among finished requests
    max_generated: int = 0  # most tokens any request of the group has generated so far
    version: int = 0  # bumped whenever a policy-visible group fact changes

    def record_progress(self, req: RequestState) -> None:
        """Note how far `req` got (after each chunk)."""
        if req.generated > self.max_generated:
            self.max_generated = req.generated
            self.version += 1

    def record_finished(self, req: RequestState) -> None:
        """Note that `req` finished with `req.generated` tokens."""
        self.record_progress(req)
        self.num_finished += 1
        n = req.generated
        self.finished_max_len = n if self.finished_max_len is None else max(self.finished_max_len, n)
        self.version += 1

    @property
    def length_estimate(self) -> int:
        """Seer's L_g: max finished length in the group (raised to the most tokens an unfinished
        sibling has already generated: the group is at least that long); the original
        max_tokens while no request of the group has finished."""
        if self.finished_max_len is None:
            return self.max_tokens
        return max(self.finished_max_len, self.max_generated)


@dataclasses.dataclass(eq=False)
class RequestState:
    """One request (one response of a group) as the controller tracks it."""

    request_id: str
    group: GroupState
    sample_index: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    is_probe: bool = False
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # per token [MoE layer][k] expert ids, with SamplingParams.return_routed_experts
    routed_experts: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # the weight version each run of its tokens was generated under: [version, tokens] segments
    weight_versions: list[list[int]] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    kv_handle: str | None = None
    # where it is: "buffer" | "running" | "done"
    status: str = "buffer"
    instance_id: int | None = None  # running on
    pinned_instance: int | None = None  # non-divided policies
    last_instance: int | None = None  # instance of the last completed chunk (holds its KV)
    instances_visited: list[int] = dataclasses.field(default_factory=list)
    num_chunks: int = 0
    in_flight_tokens: int = 0  # tokens its running chunk has generated, as last reported
    reserved_pages: int = 0
    chunk_max_new: int = 0
    # times on the driver's clock (seconds since the rollout started)
    submitted_at: float = 0.0
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    # counters
    preemptions: int = 0
    reprefill_tokens: int = 0
    migrations: int = 0
    decode_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    kv_bytes_imported: int = 0
    kv_bytes_exported: int = 0
    # buffer bookkeeping (owned by the policy)
    in_buffer: bool = False
    buffer_token: int = -1
    enqueue_seq: int = -1

    @property
    def group_id(self) -> str:
        return self.group.group_id

    @property
    def generated(self) -> int:
        return len(self.output_ids)

    @property
    def known_generated(self) -> int:
        """Tokens known to be generated: finished chunks plus the running chunk's reported
        progress (a lower bound on the request's length while it runs)."""
        return len(self.output_ids) + self.in_flight_tokens

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.generated


class Policy(abc.ABC):
    """Orders the request buffer. Subclasses implement `_push` and `_pop`."""

    name: ClassVar[str] = ""
    divided: ClassVar[bool] = True
    kv_admission: ClassVar[bool] = True
    # the keys of `policy.*` options this policy reads in bind(); others are a ConfigError
    option_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._tokens = 0
        self._pushes = 0
        self.pops = 0
        self.size = 0
        self.groups: Sequence[GroupState] = ()
        self.requests: Sequence[RequestState] = ()

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        """`options` as a dict; ConfigError naming any key this policy does not read."""
        unknown = sorted(set(options) - set(cls.option_keys))
        if unknown:
            raise ConfigError(f"policy {cls.name!r} has no option(s) {unknown}; "
                              f"allowed: {list(cls.option_keys)}")
        return dict(options)

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        """Called once before the rollout with all groups (and their requests) and this policy's
        own options (`policy.*` config keys, checked against `option_keys`)."""
        self.groups = groups
        self.requests = [r for g in groups for r in g.requests]

    def push(self, req: RequestState, requeue: bool = False) -> None:
        """`req` enters the buffer; `requeue` keeps its place in line (placement found no room)."""
        if req.in_buffer:
            raise RuntimeError(f"{req.request_id} is already in the buffer")
        self._tokens += 1
        req.buffer_token = self._tokens
        req.in_buffer = True
        if requeue:
            self.pops -= 1  # `pops` counts requests actually dispatched
        else:
            self._pushes += 1
            req.enqueue_seq = self._pushes
        self.size += 1
        self._push(req)

    def _repush(self, req: RequestState) -> None:
        """Re-key a buffered request (its key changed): a fresh buffer token kills the heap
        entries pushed for it before."""
        self._tokens += 1
        req.buffer_token = self._tokens
        self._push(req)

    def pop(self) -> RequestState | None:
        """The next request to run, removed from the buffer; None when the buffer is empty."""
        if self.size == 0:
            return None
        req = self._pop()
        if req is None:
            raise RuntimeError(f"policy {self.name} lost track of {self.size} buffered requests")
        req.in_buffer = False
        self.size -= 1
        self.pops += 1
        return req

    def __len__(self) -> int:
        return self.size

    def on_request_finished(self, req: RequestState) -> None:
        """A request finished (EOS or budget): its output length is known. Called before the
        controller would push anything else; `req.group` is already updated."""
        return None

    def on_chunk_end(self, req: RequestState) -> None:
        """A chunk of `req` ended unfinished (`req.group` updated); `req` is pushed right after."""
        return None

    def wants_progress(self) -> bool:
        """True when the policy would use in-flight progress (`RequestState.in_flight_tokens`)
        at the next chunk event; the controller then reads `Instance.running_progress()` first."""
        return False

    def estimate_remaining(self, req: RequestState) -> int | None:
        """The policy's estimate of `req`'s remaining output tokens (None: no estimate). Used to
        size chunks when the controller's `estimate_chunks` is on."""
        return None

    def priority(self, req: RequestState) -> int:
        """ChunkRequest.priority for this request's next chunk (1 = high-priority class)."""
        return 0

    @abc.abstractmethod
    def _push(self, req: RequestState) -> None: ...

    @abc.abstractmethod
    def _pop(self) -> RequestState | None: ...

    @staticmethod
    def _live(req: RequestState, token: int) -> bool:
        return req.in_buffer and req.buffer_token == token


class LazyHeap:
    """A min-heap of (key, token, request) entries; dead entries are skipped on peek/pop."""

    def __init__(self) -> None:
        self._h: list[tuple] = []
        self._n = 0

    def push(self, key: tuple, req: RequestState, extra: Any = None) -> None:
        self._n += 1
        heapq.heappush(self._h, (key, self._n, req.buffer_token, extra, req))

    def peek(self, alive) -> RequestState | None:
        """First entry for which alive(req, token, extra) holds, dropping dead ones."""
        h = self._h
        while h:
            _, _, token, extra, req = h[0]
            if alive(req, token, extra):
                return req
            heapq.heappop(h)
        return None

    def peek_entry_key(self) -> tuple | None:
        return self._h[0][0] if self._h else None

    def __len__(self) -> int:
        return len(self._h)


@dataclasses.dataclass(frozen=True)
class Hindsight:
    """What a benchmark knows about a workload after the fact (true lengths from a trace or an
    earlier run; a synthetic workload's generating distributions). Production policies never see
    it; the analysis catalog (`seer_jax.analysis.policies`) builds its oracles from it."""

    true_lengths: Mapping[str, int] | None = None  # request_id -> output tokens
    length_distributions: Mapping[str, tuple[float, float]] | None = None  # group -> (mu, sd)


class PolicyCatalog:
    """Policy names a run may use, and how to build each one.

    `classes`: name -> Policy class. `builders`: name -> function of a `Hindsight`, for the
    (analysis) policies that need facts a real rollout cannot have; the others are built with
    no arguments.
    """

    def __init__(self, classes: Mapping[str, type[Policy]],
                 builders: Mapping[str, Callable[[Hindsight], Policy]] | None = None) -> None:
        self.classes = dict(classes)
        self.builders = dict(builders or {})
        self.names: tuple[str, ...] = tuple(self.classes)

    def make(self, name: str, hindsight: Hindsight | None = None) -> Policy:
        self.check(name)
        if name in self.builders:
            return self.builders[name](hindsight or Hindsight())
        return self.classes[name]()

    def check(self, name: str, key: str = "policy") -> str:
        if name not in self.classes:
            raise ConfigError(f"config.{key}={name!r} is invalid; allowed: {sorted(self.names)}")
        return name

    def check_options(self, options_by_name: Mapping[str, Mapping[str, Any]], key: str) -> None:
        """Options keyed by policy name (`policy.<name>.<option>`): every name must be a policy
        of this catalog and every option one that policy reads."""
        for name, opts in options_by_name.items():
            self.check(name, key)
            try:
                self.classes[name].check_options(opts)
            except ConfigError as e:
                raise ConfigError(f"config.{key}.{name}: {e}") from None


def options_for(policy: Policy, options_by_name: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The options of `policy` from `policy.<name>.*` config: its own name's entry, else the
    nearest base class's (an analysis variant of seer reads seer's options)."""
    for cls in type(policy).__mro__:
        name = getattr(cls, "name", "")
        if name and name in options_by_name:
            return dict(options_by_name[name])
    return {}
