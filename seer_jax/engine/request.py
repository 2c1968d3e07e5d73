"""A request inside one engine: its tokens, pages, progress and status.

Status is an explicit state machine (`RequestStatus`), not membership in the scheduler's queues:

    WAITING --admit--> RUNNING --finish / abort--> FINISHED
       ^                  |
       +----preempt-------+            WAITING --abort--> FINISHED

WAITING: queued without pages (new, preempted, or carrying imported / swapped-out KV);
RUNNING: holds pages and is scheduled every step it fits; FINISHED: ended (eos, stop, length,
abort) and left the engine. Any other transition is a bug and raises.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import numpy as np

from seer_jax.errors import SeerError
from seer_jax.model.sampling_params import SamplingParams

if TYPE_CHECKING:
    from seer_jax.engine.types import KVBlob, RequestMetrics


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ALLOWED = {
    RequestStatus.WAITING: (RequestStatus.RUNNING, RequestStatus.FINISHED),
    RequestStatus.RUNNING: (RequestStatus.WAITING, RequestStatus.FINISHED),
    RequestStatus.FINISHED: (),
}


@dataclasses.dataclass(eq=False)
class Request:
    """Tokens live in `token_ids` [len(prompt) + len(output at submission) + max_tokens] int32,
    allocated once and appended in place (`append_token`); the first `num_tokens` are valid.
    `prompt` and `output` stay as lists for outputs and prefix keys. `row`: the request's row of
    the persistent step rows (`batch.RequestRows`) while it holds pages, else -1."""

    request_id: str
    prompt: list[int]
    output: list[int]  # all generated tokens (earlier submissions + this one)
    base_len: int  # len(output) at submission
    max_tokens: int  # new tokens allowed in this submission
    sampling: SamplingParams
    metrics: RequestMetrics
    logprobs: list[float] = dataclasses.field(default_factory=list)
    tops: list = dataclasses.field(default_factory=list)
    routed_experts: list = dataclasses.field(default_factory=list)  # per token [moe layers][k]
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # positions whose KV is in `pages`
    swapped: KVBlob | None = None  # KV waiting on the host (imported or swapped out)
    admitted_at: int = 0  # engine step of the last admission (preemption picks the latest)
    keep_kv: bool = False
    group_id: str = ""
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    row: int = -1
    # with overlap: the last token (at num_tokens - 1) was sampled by a step still in flight,
    # at row `pending_row` of its outputs (-1: every token is on the host); `pending_step` is
    # that step's number
    pending_row: int = -1
    pending_step: int = -1

    def __post_init__(self) -> None:
        n_prompt, n = len(self.prompt), len(self.prompt) + len(self.output)
        self.token_ids = np.empty(n + self.max_tokens, np.int32)
        self.token_ids[:n_prompt] = self.prompt
        self.token_ids[n_prompt:n] = self.output
        self.num_tokens = n
        self.prompt_key = tuple(self.prompt)  # prefix-cache key

    def to(self, status: RequestStatus) -> None:
        """Move to `status`; SeerError if the state machine does not allow it."""
        if status not in _ALLOWED[self.status]:
            raise SeerError(f"request {self.request_id!r}: {self.status.value} -> {status.value} "
                            "is not a valid transition")
        self.status = status

    def append_token(self, token: int) -> None:
        self.token_ids[self.num_tokens] = token
        self.num_tokens += 1
        self.output.append(token)

    def append_tokens(self, tokens: list[int]) -> None:
        n = self.num_tokens
        self.token_ids[n:n + len(tokens)] = tokens
        self.num_tokens = n + len(tokens)
        self.output.extend(tokens)

    @property
    def tokens(self) -> np.ndarray:
        """[num_tokens] int32 view: prompt, then every generated token."""
        return self.token_ids[:self.num_tokens]

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet (1: a decode)."""
        return self.num_tokens - self.num_computed

    @property
    def num_new(self) -> int:
        """New tokens of this submission, the one still on the device included."""
        return self.num_tokens - len(self.prompt) - self.base_len

    @property
    def num_committed_new(self) -> int:
        """New tokens of this submission that are on the host (in `output`)."""
        return len(self.output) - self.base_len

    @property
    def done(self) -> bool:
        """Its last token is sampled (maybe still on the device): nothing more to schedule."""
        return self.num_new >= self.max_tokens

    def reserve_token(self, row: int, step: int) -> int:
        """A token sampled on the device, not yet on the host: it takes the next position
        (returned) and is read on the device by the next step (`pending_row`)."""
        pos = self.num_tokens
        self.token_ids[pos] = 0
        self.num_tokens += 1
        self.pending_row, self.pending_step = row, step
        return pos

    def commit_token(self, pos: int, token: int, step: int) -> None:
        """The reserved token at `pos` arrived from the device (in order)."""
        self.token_ids[pos] = token
        self.output.append(token)
        if self.pending_step == step:
            self.pending_row = self.pending_step = -1
