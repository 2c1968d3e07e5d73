"""The controller's settings (`ControllerConfig`) and the sampling seed of each request
(`request_seed`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from seer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    """Controller settings (plain values, so an ml_collections config maps onto it; frozen).

    chunk_size: max new tokens per chunk (divided policies); >= 1.
    balance_threshold: in-flight spread (max - min chunks across instances) above which placement
        ignores affinity and picks the least-loaded instance (paper: 32); >= 0.
    max_in_flight_per_instance: cap on chunks in flight per instance (divided policies). 0 = auto:
        the instance's batch limit (`InstanceLoad.max_running`, e.g. max_num_seqs), so a chunk
        waits in the controller's buffer, where the policy orders it, not in an instance's own
        first-come queue; -1 = no cap (KV budget only).
    dispatch_lookahead: how many buffered requests a dispatch round may skip over when the
        policy's first choice fits nowhere right now; >= 1.
    per_request_seeds: derive each request's sampling seed from (seed, group index, sample index)
        so the G samples of a group differ and stay the same under every policy.
    estimate_chunks: size a chunk by the policy's remaining-length estimate when it has one
        (seer: its quantile of the remaining length):
        max_new_tokens = min(chunk_size, remaining budget,
                             max(min_chunk_size, ceil(estimate_margin x estimate))).
        KV reservations then track what requests will really use (more concurrency, still no
        preemption); a request that outlives its estimate simply gets another chunk.
        Off by default: chunks are min(chunk_size, original_max_tokens - generated).

    Policy-specific settings (seer's estimator, quantile and starvation guard) are the policy's
    own options (`policy_options`), not the controller's.
    """

    chunk_size: int = 2048
    balance_threshold: int = 32
    max_in_flight_per_instance: int = 0
    dispatch_lookahead: int = 8
    per_request_seeds: bool = True
    estimate_chunks: bool = False
    estimate_margin: float = 1.25
    min_chunk_size: int = 32

    def validate(self) -> ControllerConfig:
        checks = (
            ("chunk_size", self.chunk_size, ">= 1", lambda v: v >= 1),
            ("balance_threshold", self.balance_threshold, ">= 0", lambda v: v >= 0),
            (
                "max_in_flight_per_instance",
                self.max_in_flight_per_instance,
                ">= -1 (0 = the instance's batch limit, -1 = no cap)",
                lambda v: v >= -1,
            ),
            ("dispatch_lookahead", self.dispatch_lookahead, ">= 1", lambda v: v >= 1),
            ("min_chunk_size", self.min_chunk_size, ">= 1", lambda v: v >= 1),
        )
        for key, value, allowed, ok in checks:
            if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
                raise ConfigError(f"{key}={value!r} is invalid; allowed: an integer {allowed}")
        for key in ("per_request_seeds", "estimate_chunks"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r} is invalid; allowed: True or False")
        m = self.estimate_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not m >= 1.0:
            raise ConfigError(f"estimate_margin={m!r} is invalid; allowed: a number >= 1.0")
        return self

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> ControllerConfig:
        """From a dict / ConfigDict; unknown keys are a ConfigError naming the known ones."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown controller config key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values).validate()


def request_seed(seed: int, group_index: int, sample_index: int) -> int:
    """The sampling seed of one request: a hash of (seed, group index, sample index)."""
    return int(np.random.SeedSequence([seed, group_index, sample_index]).generate_state(1)[0] >> 1)
