"""A deployment config's engine step, compiled for its own chip: does it fit, per the compiler?

`validate_config` checks a config from the model's dimensions (weights + KV per device).
`compile_config` compiles the step a slice of the config runs (its tp, model shapes, page size,
batch limits and KV cache) with the chip's compiler and reads the per-device bytes from
`memory_analysis()`: arguments (weights, cache, batch), outputs, temporaries and code. A step that
does not fit the device's HBM is a ConfigError naming the config, the bytes and the chip.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from seer_jax.costs import GIB
from seer_jax.errors import ConfigError
from seer_jax.hardware.step import STEP_KINDS, CompiledStep, StepLimits, compile_step
from seer_jax.hardware.targets import Target, get_target
from seer_jax.integrations.deploy_config import (
    engine_config,
    model_config,
    validate_config,
    weight_bytes_per_device,
)

PLATFORM_OF = {"tpu": "tpu", "gpu": "gpu"}


def config_target(c: ml_collections.ConfigDict) -> Target:
    """The compile target of a config: `mesh.chip` (v5e, v5p, v6e, h100, h200)."""
    chip = c.mesh.get("chip", "")
    if not chip:
        raise ConfigError(f"config {c.name!r}: mesh.chip is not set; set it to the chip the "
                          "slices run on to compile for it")
    target = get_target(chip)
    if target.platform != c.platform:
        raise ConfigError(f"config {c.name!r}: mesh.chip={chip!r} is a {target.platform} chip "
                          f"but platform={c.platform!r}")
    return target


def step_limits(c: ml_collections.ConfigDict) -> StepLimits:
    cfg, eng = model_config(c), engine_config(c)
    return StepLimits(page_size=eng.page_size, num_pages=eng.kv_pages(cfg.kv_bytes_per_token()),
                      max_num_seqs=eng.max_num_seqs,
                      max_num_batched_tokens=eng.max_num_batched_tokens,
                      max_prefill_seqs=eng.max_prefill_seqs,
                      max_model_len=eng.max_model_len or cfg.max_position_embeddings)


def hbm_budget(c: ml_collections.ConfigDict, target: Target) -> int:
    """Bytes a step may use per device: the config's mesh.hbm_gib_per_device when set, never
    more than the chip's HBM."""
    budget = float(c.mesh.hbm_gib_per_device) * GIB
    chip = target.spec.hbm_bytes
    return int(min(budget, chip) if budget > 0 else chip)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One compiled step's per-device bytes next to what validate_config counts."""

    config: str
    chip: str
    kind: str
    impl: str
    tp: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    weight_bytes: int
    kv_bytes: int
    budget_bytes: int

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fits": self.fits}


def compile_config(c: ml_collections.ConfigDict, impl: str = "auto",
                   kinds: tuple[str, ...] = STEP_KINDS) -> list[StepMemory]:
    """Compile every step kind of the config's slice for its chip; per-device memory of each.
    Raises ConfigError when a step does not fit (the compiler refusing it included)."""
    validate_config(c)
    target = config_target(c)
    cfg, lim, tp = model_config(c), step_limits(c), c.mesh.tp
    budget = hbm_budget(c, target)
    weights = weight_bytes_per_device(cfg, tp)
    out = []
    for kind in kinds:
        step = _compile(c, cfg, target, tp, lim, kind, impl, budget)
        mem = StepMemory(c.name, target.name, kind, step.impl, tp, step.argument_bytes,
                         step.output_bytes, step.alias_bytes, step.temp_bytes, step.peak_bytes,
                         weights, step.kv_bytes, budget)
        if not mem.fits:
            raise ConfigError(
                f"config {c.name!r}: the {kind} step (impl={step.impl}) needs "
                f"{mem.peak_bytes / GIB:.2f} GiB per device per the compiler (arguments "
                f"{mem.argument_bytes / GIB:.2f} + temporaries {mem.temp_bytes / GIB:.2f} GiB), "
                f"more than the {budget / GIB:.2f} GiB of HBM per {target.name} device; lower "
                "engine.kv_memory_gib or the batch limits")
        out.append(mem)
    return out


def _compile(c, cfg, target: Target, tp: int, lim: StepLimits, kind: str, impl: str,
             budget: int) -> CompiledStep:
    try:
        return compile_step(cfg, target.name, tp, lim, kind, impl=impl,
                            layer_weights=c.engine.get("layer_weights", "auto"))
    except Exception as e:  # the compiler's own refusal, e.g. out of HBM on TPU
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg and "exceeds" not in msg:
            raise
        first = next((line for line in msg.splitlines() if "exceed" in line), msg.splitlines()[0])
        raise ConfigError(f"config {c.name!r}: the {kind} step (impl={impl}) does not fit "
                          f"a {target.name} device ({budget / GIB:.2f} GiB budget) per the "
                          f"compiler: {first.strip()}") from None
