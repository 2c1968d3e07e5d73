"""The engine's small public types, below the step loop: its config, a request's metrics and
output, a step's statistics and a request's KV on the host. JAX-free, so configs parse before
jax is imported, and the modules of the loop (`request`, `scheduler`, `kv_cache`) import them
without importing `engine`."""

from __future__ import annotations

import dataclasses

import numpy as np

from seer_jax.errors import ConfigError, InputError
from seer_jax.model.config import LAYER_WEIGHTS

# attention implementations (`attention_backend`): auto picks the platform's kernel
ENGINE_IMPLS = ("auto", "reference", "cpu", "tpu", "gpu")


@dataclasses.dataclass
class KVBlob:
    """A request's KV on the host: tokens + K/V of its first `num_computed` positions."""

    prompt_ids: list[int]
    output_ids: list[int]
    # [num_layers, num_kv_heads, num_computed, head_dim]; with multi-head latent attention k
    # holds the latent rows [num_layers, 1, num_computed, kv_lora_rank + rope dim], v is empty
    k: np.ndarray
    v: np.ndarray

    @property
    def num_computed(self) -> int:
        return int(self.k.shape[2])

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)


class RequestFinished(InputError):
    """The request asked for (to export its KV) already finished; its output is on its way."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    num_pages: int = 0  # 0: derive from kv_memory_gib
    kv_memory_gib: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    max_prefill_seqs: int = 4
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    impl: str = "auto"  # attention: auto | reference | cpu | tpu | gpu (see attention_backend)
    # layer weights: stacked (one scanned layer loop) | per_layer (unrolled, no weight slicing)
    # | auto (per_layer on GPUs, whose GEMMs would read a copy of each sliced layer)
    layer_weights: str = "auto"
    prefix_sharing: bool = True
    preemption: str = "recompute"  # or "swap"
    max_top_logprobs: int = 0
    # MoE models: sample steps return the routers' expert ids, for requests that ask
    # (`SamplingParams.return_routed_experts`); verify steps return those of every accepted token
    return_routed_experts: bool = False
    speculation: bool = False  # grouped speculative decoding (drafts from the group context)
    # plan and dispatch step N+1 while step N runs on the device, then commit step N (its
    # sampled tokens feed step N+1 on the device); finished requests come back one step later.
    # With speculation, a step that verifies drafts, or precedes one, is committed before the
    # next is planned (its accepted tokens decide the next step's positions and drafts).
    overlap: bool = True
    # per-step statistics kept (the most recent); an engine a trainer keeps alive for days must
    # not grow without bound
    max_step_stats: int = 100_000

    def kv_pages(self, kv_bytes_per_token: int) -> int:
        """KV cache pages: `num_pages`, or as many as `kv_memory_gib` holds (at least 2)."""
        return self.num_pages or max(
            2, int(self.kv_memory_gib * 2**30 // (kv_bytes_per_token * self.page_size)))

    def validate(self) -> None:
        checks = {
            "page_size": self.page_size >= 1, "num_pages": self.num_pages >= 0,
            "kv_memory_gib": self.kv_memory_gib > 0, "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_prefill_seqs": self.max_prefill_seqs >= 1, "max_model_len": self.max_model_len >= 0,
            "max_top_logprobs": self.max_top_logprobs >= 0,
            "max_step_stats": self.max_step_stats >= 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"engine config {key}={getattr(self, key)!r} is out of range")
        if self.preemption not in ("recompute", "swap"):
            raise ConfigError(f"engine config preemption={self.preemption!r}: allowed 'recompute', 'swap'")
        if self.impl not in ENGINE_IMPLS:
            raise ConfigError(f"engine config impl={self.impl!r}: allowed "
                              f"{', '.join(map(repr, ENGINE_IMPLS))}")
        if self.layer_weights not in LAYER_WEIGHTS:
            raise ConfigError(f"engine config layer_weights={self.layer_weights!r}: allowed "
                              f"{', '.join(map(repr, LAYER_WEIGHTS))}")


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_steps: int = 0
    # decode steps (each emits one token plus the draft tokens it accepted), with or without
    # drafts: spec_accepted / decode_steps is the mean accepted draft length per step
    decode_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    finish_step: int = -1  # the engine step whose tokens ended the request


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated by this submission (not the earlier output_ids)
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None  # "eos" | "stop" | "length" | "abort"
    metrics: RequestMetrics
    kv: KVBlob | None = None  # with add_request(keep_kv=True): the KV when it ended on "length"
    # with SamplingParams.return_routed_experts: per token, per MoE layer, the chosen expert ids
    routed_experts: list[list[list[int]]] | None = None


@dataclasses.dataclass
class StepStats:
    step: int
    batch_size: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float
    kv_tokens: int
    # where the step went (time.perf_counter seconds, whatever the engine clock): planning
    # (schedule, drafts, batch build), the runner's phases (`ModelRunner.timings`), commit
    # (everything after: emissions, appends, finishes); compile_s: compiling a new step shape
    # (zero in steady state). With overlap a step's phases span two step() calls: plan and h2d
    # in the call that dispatches it, device (dispatch + waiting for it), d2h and commit in the
    # next one.
    plan_s: float = 0.0
    h2d_s: float = 0.0
    device_s: float = 0.0
    d2h_s: float = 0.0
    commit_s: float = 0.0
    compile_s: float = 0.0
    # the part of device_s the host spent blocked on the step's outputs: with overlap, a wait
    # means the next step was already dispatched when this one ended (no device idle between)
    wait_s: float = 0.0
    # how the step's tokens reached the MoE experts (`moe.expert_dispatch`: "local", "psum" or
    # "all_to_all"; "" for a dense model)
    moe_dispatch: str = ""
