"""What a rollout hands back (`ResponseResult` per response, `ControllerStats` over the
rollout) and what the controller reports to as it goes (`ProgressFn`, `JournalSink`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from seer_jax.rollout.core.journal import RequestRecord
from seer_jax.rollout.core.types import FinishReason


@dataclasses.dataclass
class ResponseResult:
    """One response of the rollout. Times are on the driver's clock, seconds since the start."""

    request_id: str
    group_id: str
    group_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    submitted_at: float
    first_scheduled_at: float | None
    first_token_at: float | None
    finished_at: float
    num_chunks: int
    instances: list[int]  # instance of every chunk, in order (lost chunks included)
    migrations: int
    preemptions: int
    reprefill_tokens: int
    text: str | None = None
    # [weight version, tokens] segments in token order: the policy weights each run of tokens
    # was generated under (several versions when the request was carried over a weight sync)
    weight_versions: list[list[int]] = dataclasses.field(default_factory=list)
    # with SamplingParams.return_routed_experts: per token, per MoE layer, the expert ids routed
    # at the position that produced it (chunks concatenated in order), else None
    routed_experts: list[list[list[int]]] | None = None

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.submitted_at

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class ControllerStats:
    chunks: int = 0
    migrations: int = 0
    preemptions: int = 0
    reprefill_tokens: int = 0
    reprefill_chunks: int = 0  # chunks that recomputed their context (no KV in the pool)
    kv_bytes_imported: int = 0
    kv_bytes_exported: int = 0
    decode_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    lost_instances: list[int] = dataclasses.field(default_factory=list)
    redispatched_chunks: int = 0
    replacement_instances: list[int] = dataclasses.field(default_factory=list)
    dispatch_rounds: int = 0


ProgressFn = Callable[[int, int, int, float], None]  # (responses done, total, output tokens, now)


class JournalSink(Protocol):
    """Where the controller records progress as it happens (`journal.JournalWriter`)."""

    def chunk_end(self, request_id: str, total: int, tokens: list[int], logprobs: list[float],
                  version: int, routed_experts: list | None = None) -> None:
        """A chunk ended unfinished: the request has `total` tokens, `tokens` the chunk's."""

    def finished(self, rec: RequestRecord) -> None:
        """A request finished (every token, its finish reason)."""
