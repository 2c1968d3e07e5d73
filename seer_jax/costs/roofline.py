"""The roofline step-time model of one mesh slice (`RooflineCostModel`): a step reads the
weights it touches (for a mixture of experts: the shared weights and the distinct experts the
batch hits) plus the KV it attends over from HBM (and the activations the expert dispatch
moves) and does 2·active_params FLOPs per token
plus the attention FLOPs; its time is the larger of bytes / HBM bandwidth and FLOPs / peak, plus
fixed overheads. Also its KV capacity and pool transfer time."""

from __future__ import annotations

import dataclasses

from seer_jax.costs.presets import GIB, AcceleratorSpec, ModelSpec
from seer_jax.costs.spec import expected_distinct_experts
from seer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    """Roofline step time of one instance (a slice of `chips` chips).

    expert_parallel: the routed experts are sharded over this many instances that step together
      (DP-attention + EP, e.g. Kimi-K2 over 256 GPUs): each instance stores and reads 1/ep of the
      experts, touched by ep × its own batch. 1 = each instance holds the whole model.
    kv_replicas: copies of the KV cache inside the slice (MLA under tensor parallelism replicates
      the latent on every rank): divides capacity and multiplies KV bytes read.
    mfu / mbu: achievable fraction of peak FLOP/s and of HBM bandwidth.
    """

    model: ModelSpec
    accelerator: AcceleratorSpec
    chips: int = 1
    expert_parallel: int = 1
    kv_replicas: int = 1
    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 2e-3
    per_seq_overhead_s: float = 5e-6
    memory_utilization: float = 0.9
    page_size: int = 16
    pool_bytes_per_s: float = 20e9

    def __post_init__(self) -> None:
        checks = [
            ("chips", self.chips, self.chips >= 1, ">= 1"),
            ("expert_parallel", self.expert_parallel, self.expert_parallel >= 1, ">= 1"),
            ("kv_replicas", self.kv_replicas, self.kv_replicas >= 1, ">= 1"),
            ("mfu", self.mfu, 0 < self.mfu <= 1, "in (0, 1]"),
            ("mbu", self.mbu, 0 < self.mbu <= 1, "in (0, 1]"),
            ("step_overhead_s", self.step_overhead_s, self.step_overhead_s >= 0, ">= 0"),
            ("per_seq_overhead_s", self.per_seq_overhead_s, self.per_seq_overhead_s >= 0, ">= 0"),
            ("memory_utilization", self.memory_utilization, 0 < self.memory_utilization <= 1,
             "in (0, 1]"),
            ("page_size", self.page_size, self.page_size >= 1, ">= 1"),
            ("pool_bytes_per_s", self.pool_bytes_per_s, self.pool_bytes_per_s > 0, "> 0"),
            ("accelerator.peak_flops", self.accelerator.peak_flops,
             self.accelerator.peak_flops > 0, "> 0"),
            ("accelerator.hbm_bytes_per_s", self.accelerator.hbm_bytes_per_s,
             self.accelerator.hbm_bytes_per_s > 0, "> 0"),
            ("accelerator.hbm_bytes", self.accelerator.hbm_bytes,
             self.accelerator.hbm_bytes > 0, "> 0"),
        ]
        for key, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"cost model {key}={value!r} is invalid: must be {allowed}")

    # -- bytes and flops ------------------------------------------------------------------------

    @property
    def _expert_params(self) -> float:
        return self.model.total_params - self.model.shared_params

    def weight_bytes_stored(self) -> float:
        """Weight bytes held by this instance (all its chips together)."""
        m = self.model
        return (m.shared_params + self._expert_params / self.expert_parallel) * m.bytes_per_param

    def weight_bytes_read(self, num_tokens: float) -> float:
        """Weight bytes one step reads for `num_tokens` tokens of this instance.

        Dense: all weights. MoE: the shared weights, plus each routed expert stored here that the
        EP group's tokens (ep × num_tokens, routed uniformly) touch, read once: per MoE layer
        (E/ep)·(1 − (1 − k/E)^(ep·tokens)) of the E/ep local experts. Without an expert layout
        the experts are one pool of which a token touches the fraction (active − shared) /
        (total − shared).
        """
        m = self.model
        if not m.is_moe or self._expert_params <= 0:
            return m.total_params * m.bytes_per_param
        ep = self.expert_parallel
        tokens = max(num_tokens, 0.0) * ep
        if m.has_expert_layout:
            touched = expected_distinct_experts(m.num_experts, m.experts_per_tok, tokens) / ep
            return (m.shared_params + m.num_moe_layers * touched * m.params_per_expert
                    ) * m.bytes_per_param
        frac = (m.active_params - m.shared_params) / self._expert_params
        touched = 1.0 - (1.0 - frac) ** tokens
        return (m.shared_params + touched * self._expert_params / ep) * m.bytes_per_param

    def step_flops(self, batch_size: int, num_tokens: float, kv_tokens_read: float) -> float:
        m = self.model
        dense = 2.0 * m.matmul_params * num_tokens
        # Each query token attends over its sequence's context: num_tokens / batch_size queries per
        # sequence, each over (on average) kv_tokens_read / batch_size keys.
        q_per_seq = num_tokens / max(batch_size, 1)
        pairs = kv_tokens_read * q_per_seq
        return dense + m.attn_flops_per_pair * pairs

    def step_bytes(self, num_tokens: float, kv_tokens_read: float) -> float:
        """Weights read, KV read and the expert dispatch's activations (`ModelSpec`)."""
        kv = kv_tokens_read * self.model.kv_bytes_per_token * self.kv_replicas
        acts = max(num_tokens, 0.0) * self.model.expert_activation_bytes_per_token
        return self.weight_bytes_read(num_tokens) + kv + acts

    # -- the interface ---------------------------------------------------------------------------

    def step_time(
        self,
        batch_size: int,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        kv_tokens_read: int,
    ) -> float:
        num_tokens = num_prefill_tokens + num_decode_tokens
        if num_tokens <= 0:
            return 0.0
        acc = self.accelerator
        t_mem = self.step_bytes(num_tokens, kv_tokens_read) / (
            acc.hbm_bytes_per_s * self.mbu * self.chips
        )
        t_flop = self.step_flops(batch_size, num_tokens, kv_tokens_read) / (
            acc.peak_flops * self.mfu * self.chips
        )
        return self.step_overhead_s + self.per_seq_overhead_s * batch_size + max(t_mem, t_flop)

    __call__ = step_time

    def spec_step_time(self, batch_size: int, gamma: int, kv_tokens_read: int) -> float:
        """A decode step verifying `gamma` draft tokens per sequence (gamma 0 = plain decode)."""
        return self.step_time(batch_size, 0, batch_size * (1 + gamma), kv_tokens_read)

    def kv_transfer_time(self, num_tokens: int) -> float:
        """Seconds to move `num_tokens` tokens of KV between this instance and the global pool."""
        return num_tokens * self.model.kv_bytes_per_token / self.pool_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        free = (
            self.accelerator.hbm_bytes * self.chips * self.memory_utilization
            - self.weight_bytes_stored()
        )
        if free <= 0:
            raise ConfigError(
                f"model {self.model.name} ({self.weight_bytes_stored() / GIB:.1f} GiB of weights "
                f"per instance) does not fit in {self.chips} x {self.accelerator.name} at "
                f"memory_utilization={self.memory_utilization}: raise chips_per_instance or "
                "expert_parallel"
            )
        return int(free // (self.model.kv_bytes_per_token * self.kv_replicas))

    def kv_capacity_pages(self) -> int:
        return self.kv_capacity_tokens() // self.page_size

    def describe(self) -> dict:
        return {
            "kind": "roofline",
            "model": self.model.name,
            "accelerator": self.accelerator.name,
            "chips": self.chips,
            "expert_parallel": self.expert_parallel,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "weight_gib_per_instance": self.weight_bytes_stored() / GIB,
            "kv_capacity_tokens": self.kv_capacity_tokens(),
            "decode_step_s_b1": self.spec_step_time(1, 0, 1024),
            "decode_step_s_b64": self.spec_step_time(64, 0, 64 * 8192),
        }
