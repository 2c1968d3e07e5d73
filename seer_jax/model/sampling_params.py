"""Per-request sampling parameters (plain data, no JAX: the controller and the CLI import them
without starting a backend)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from seer_jax.errors import InputError

FinishReason = Literal["eos", "stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters.

    temperature 0 means greedy. top_k 0 means off. The PRNG stream of a request is derived from
    (seed, number of tokens generated so far), so a request's samples do not depend on batch
    composition, chunking or which instance runs it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = True
    top_logprobs: int = 0
    # mixture-of-experts models: per generated token, the expert ids each MoE layer's router
    # chose at the position that produced it ([tokens][moe layers][experts per token])
    return_routed_experts: bool = False

    def validate(self, vocab_size: int | None = None) -> None:
        if not (self.temperature >= 0.0):
            raise InputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.top_logprobs < 0:
            raise InputError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
