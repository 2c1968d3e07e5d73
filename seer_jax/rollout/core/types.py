"""Plain data types shared by the engine, the controller, the simulator and the integrations.

Everything that crosses the instance interface is one of these message-shaped dataclasses, so an
instance can live in-process, in a Ray actor, or be simulated.
"""

from __future__ import annotations

import dataclasses

from seer_jax.model.sampling_params import FinishReason, SamplingParams  # noqa: F401 (the instance contract)


@dataclasses.dataclass
class ChunkRequest:
    """Controller -> instance: run one chunk (one scheduling decision) of a request.

    `output_ids` are the tokens generated in earlier chunks; the instance continues after them.
    `max_new_tokens` is this chunk's budget: min(chunk_size, original_max_tokens - generated).
    `kv_handle` names the request's KV in the global pool (None: not in the pool; the instance
    uses its own resident copy if it has one, else re-prefills prompt + output_ids).
    `priority` 1 marks the high-priority class (probe requests) for the speculation budget.
    """

    request_id: str
    group_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    max_new_tokens: int
    original_max_tokens: int
    sampling: SamplingParams
    kv_handle: str | None = None
    priority: int = 0


@dataclasses.dataclass
class ChunkResult:
    """Instance -> controller: a chunk ended (request finished, or its chunk budget ran out).

    finish_reason None means the request is unfinished and returns to the request buffer; its KV
    was written to the pool under `kv_handle` (None if the instance only re-prefill can restore it).
    Times are on the instance's clock.
    """

    request_id: str
    instance_id: int
    new_token_ids: list[int]
    new_logprobs: list[float]
    finish_reason: FinishReason | None
    kv_handle: str | None
    submitted_at: float
    started_at: float
    ended_at: float
    num_steps: int = 0
    preemptions: int = 0
    decode_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    kv_bytes_imported: int = 0
    kv_bytes_exported: int = 0
    reprefill_tokens: int = 0
    first_token_at: float | None = None  # when this chunk's first token was produced, if known
    # with SamplingParams.return_routed_experts: per new token, per MoE layer, the expert ids
    # routed at the position that produced it
    new_routed_experts: list[list[list[int]]] | None = None


@dataclasses.dataclass(frozen=True)
class InstanceLoad:
    """A snapshot of an instance's load, read by placement."""

    running: int
    waiting: int
    free_kv_pages: int
    total_kv_pages: int
    page_size: int
    # most requests the instance runs in one step (its batch limit, e.g. max_num_seqs); 0 = none
    max_running: int = 0

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one instance step did: its duration on the instance clock and the chunks that ended."""

    duration_s: float
    batch_size: int
    num_tokens: int
    finished: list[ChunkResult]
