"""Step-time cost models for simulated instances.

Two models share one interface, `step_time(batch_size, num_prefill_tokens, num_decode_tokens,
kv_tokens_read) -> seconds` (the function `sim.instance.SimulatedInstance` takes):

- `RooflineCostModel`: a roofline of one mesh slice (an instance). A step reads the weights it
  touches plus the KV it attends over from HBM, and does 2·active_params FLOPs per token plus the
  attention FLOPs (a mixture of experts reads its shared weights and each routed expert the
  batch hits once: `expected_distinct_experts`; MLA attends over its latent cache, absorbed);
  its time is the larger of bytes / HBM bandwidth and FLOPs / peak (each derated by an
  achievable fraction), plus a fixed per-step overhead and a small per-sequence overhead.
  Accelerator presets are per chip; a slice has `chips` of them.
- `ProfileCostModel`: calibrated from a step-time profile measured on the real engine
  (`seer-jax bench --profile`), see `StepProfile` for the JSON schema.

Speculative decoding: a step that verifies `gamma` draft tokens for each of B sequences feeds
B·(1+gamma) query tokens, each attending over its sequence's context, so
`spec_step_time(B, gamma, kv) = step_time(B, 0, B·(1+gamma), kv)` (kv = context tokens summed over
the batch, read once per step, not once per query).

KV capacity: `kv_capacity_pages()` = (HBM of the slice × memory_utilization − weights stored) /
(page_size × KV bytes per token × kv_replicas).
"""

from seer_jax.costs.presets import (
    ACCELERATORS,
    GIB,
    MODELS,
    AcceleratorSpec,
    ModelSpec,
    get_accelerator,
    get_model,
)
from seer_jax.costs.profile import (
    PROFILE_SCHEMA,
    ProfileCostModel,
    ProfilePoint,
    StepProfile,
    profile_from_cost_model,
)
from seer_jax.costs.roofline import RooflineCostModel
from seer_jax.costs.spec import (
    expected_distinct_experts,
    gqa_moe_spec,
    mla_moe_spec,
    spec_from_hf_config,
)

__all__ = ["ACCELERATORS", "GIB", "MODELS", "PROFILE_SCHEMA", "AcceleratorSpec", "ModelSpec",
           "ProfileCostModel", "ProfilePoint", "RooflineCostModel", "StepProfile",
           "expected_distinct_experts", "get_accelerator", "get_model", "gqa_moe_spec",
           "mla_moe_spec", "profile_from_cost_model", "spec_from_hf_config"]
