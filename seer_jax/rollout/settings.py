"""The rollout config parsed once into typed, frozen settings (`RolloutSettings.from_config`).

The `ml_collections.ConfigDict` of `seer_jax.rollout.config` is the file format and the
`--config.key=value` override surface; `validate_config` checks it and `from_config` turns it
into the settings below, which is all that `run_rollout` and the code it calls read: the model and
prompts, sampling, the policies, the controller (`ControllerConfig`), the engine
(`EngineConfig`), where instances run (`BackendSettings`, with its `RayBackendConfig`), the KV
pool between chunks (`PoolSettings`), the journal, speculation and its draft service
(`SpeculationSettings`, with its `SyncConfig`), the emulated step time, fault injection and
partial rollout.

Parsing the engine settings imports the engine (and so jax): a caller that must set up devices
first (`seer_jax.rollout.api.ensure_cpu_devices`) validates, sets them up, then parses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ml_collections

from seer_jax.errors import ConfigError
from seer_jax.model.sampling_params import SamplingParams
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.config import (
    draft_sync_config,
    mooncake_config,
    ray_backend_config,
    validate_config,
)
from seer_jax.rollout.core.controller_config import ControllerConfig
from seer_jax.rollout.core.policies import CATALOG, PolicyCatalog

if TYPE_CHECKING:
    from seer_jax.costs import RooflineCostModel
    from seer_jax.drafting.replicated import SyncConfig
    from seer_jax.engine.engine import EngineConfig
    from seer_jax.rollout.backends.mooncake_pool import MooncakeConfig
    from seer_jax.rollout.core.concurrent_driver import FaultPlan


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    name: str  # a built-in name, a checkpoint directory or a .gguf path
    dtype: str


@dataclasses.dataclass(frozen=True)
class PromptSettings:
    source: str  # a built-in prompt set, or a .jsonl path
    num_prompts: int
    chat: bool  # encode with the model's chat template

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> PromptSettings:
        return cls(source=str(c.prompts), num_prompts=int(c.num_prompts), chat=bool(c.chat))


@dataclasses.dataclass(frozen=True)
class BackendSettings:
    """Where the instances run: "inprocess" (mesh slices of this process) or "ray"."""

    kind: str
    num_instances: int
    tp: int
    ray: RayBackendConfig  # the ray_* keys (read with kind "ray" only)
    replace_lost: bool
    allow_fewer_slices: bool


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """The KV pool between chunks: "host", "ray" (object store) or "mooncake". mooncake: the
    named master's config; None with kind "mooncake": start a loopback master whose clients add
    `segment_mb` each."""

    kind: str
    mooncake: MooncakeConfig | None = None
    segment_mb: int = 256


@dataclasses.dataclass(frozen=True)
class JournalSettings:
    directory: str  # "" = no journal
    fsync: bool


@dataclasses.dataclass(frozen=True)
class SpeculationSettings:
    """Grouped speculative decoding: the step-time profile its budget reads ("" = the cost
    model), the draft service of backend "ray", and its fault injection (-1 = off)."""

    enabled: bool
    profile: str
    draft_service: SyncConfig
    fault_kill_draft_service_after_chunks: int = -1

    def budget(self):
        """A fresh `SpeculationBudget` (one per engine: a budget works per engine)."""
        from seer_jax.drafting.budget import SpeculationBudget

        return SpeculationBudget.from_profile_json(self.profile or None)


@dataclasses.dataclass(frozen=True)
class StepTimeSettings:
    """Emulated step durations: "measured" (wall time of each real step) or "roofline" (the
    cost model `cost_model` on `accelerator` x `chips_per_instance`)."""

    model: str
    accelerator: str
    cost_model: str
    chips_per_instance: int

    def step_time(self, page_size: int) -> RooflineCostModel | None:
        """The roofline step-time model of the engines, None for measured steps."""
        if self.model != "roofline":
            return None
        from seer_jax.costs import RooflineCostModel, get_accelerator, get_model

        return RooflineCostModel(model=get_model(self.cost_model),
                                 accelerator=get_accelerator(self.accelerator),
                                 chips=self.chips_per_instance, page_size=page_size)


@dataclasses.dataclass(frozen=True)
class FaultSettings:
    """Kill instance `instance` after `after_chunks` chunks ended, at the moment `when` names."""

    instance: int
    after_chunks: int
    when: str

    def plan(self) -> FaultPlan:
        """A fresh `FaultPlan` (it records when it fired: one per rollout)."""
        from seer_jax.rollout.core.concurrent_driver import FaultPlan

        return FaultPlan(self.instance, self.after_chunks, self.when)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """A validated rollout config (see the module docstring)."""

    model: ModelSettings
    prompts: PromptSettings
    group_size: int
    max_tokens: int
    sampling: SamplingParams
    policies: tuple[str, ...]
    baseline: str  # ratios are taken against it when it ran (else the first policy)
    controller: ControllerConfig
    policy_options: Mapping[str, Mapping[str, Any]]  # policy name -> its options
    clock: str
    engine: EngineConfig  # speculation set from `speculation.enabled`
    backend: BackendSettings
    pool: PoolSettings
    journal: JournalSettings
    speculation: SpeculationSettings
    step_time: StepTimeSettings
    fault: FaultSettings | None  # None: no fault injection
    carry_over: bool
    target_groups: int  # 0: every group
    trace_out: str  # "" = no length trace

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict,
                    catalog: PolicyCatalog = CATALOG) -> RolloutSettings:
        """Validate `c` (`validate_config`: a ConfigError naming the key, its value and what
        is allowed) and parse it. Imports the engine (and so jax)."""
        return cls.parse(c, validate_config(c, catalog))

    @classmethod
    def parse(cls, c: ml_collections.ConfigDict, policies: list[str]) -> RolloutSettings:
        """Parse a config `validate_config` passed (`policies`: what it returned)."""
        speculation = SpeculationSettings(
            enabled=c.speculation, profile=c.spec_profile, draft_service=draft_sync_config(c),
            fault_kill_draft_service_after_chunks=c.fault_kill_draft_service_after_chunks)
        engine = _engine_config(c, speculation.enabled)
        return cls(
            model=ModelSettings(name=str(c.model), dtype=str(c.dtype)),
            prompts=PromptSettings.from_config(c),
            group_size=c.group_size, max_tokens=c.max_tokens,
            # config.engine.return_routed_experts: every response returns its routing
            sampling=SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                    seed=c.seed,
                                    return_routed_experts=engine.return_routed_experts),
            policies=tuple(policies), baseline=c.baseline,
            controller=ControllerConfig.from_mapping(c.controller.to_dict()),
            policy_options=c.policy.to_dict(), clock=c.clock,
            engine=engine,
            backend=BackendSettings(kind=c.backend, num_instances=c.num_instances, tp=c.tp,
                                    ray=ray_backend_config(c), replace_lost=c.ray_replace_lost,
                                    allow_fewer_slices=c.allow_fewer_slices),
            pool=_pool_settings(c),
            journal=JournalSettings(directory=c.journal_dir, fsync=c.journal_fsync),
            speculation=speculation,
            step_time=StepTimeSettings(model=c.time_model, accelerator=c.accelerator,
                                       cost_model=c.cost_model,
                                       chips_per_instance=c.chips_per_instance),
            fault=(FaultSettings(c.fault_kill_instance, c.fault_after_chunks, c.fault_when)
                   if c.fault_kill_instance >= 0 else None),
            carry_over=c.carry_over, target_groups=c.target_groups, trace_out=c.trace_out)


def _engine_config(c: ml_collections.ConfigDict, speculation: bool) -> EngineConfig:
    """The `EngineConfig` of `config.engine` (ConfigError naming the key when bad)."""
    from seer_jax.engine.engine import EngineConfig

    values = c.engine.to_dict()
    known = {f.name for f in dataclasses.fields(EngineConfig)} - {"speculation"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config.engine.{unknown[0]} is unknown; allowed keys: "
                          f"{', '.join(sorted(known))} (speculation: config.speculation)")
    engine = EngineConfig(**values, speculation=speculation)
    try:
        engine.validate()
    except ConfigError as e:
        raise ConfigError(str(e).replace("engine config ", "config.engine.", 1)) from None
    return engine


def _pool_settings(c: ml_collections.ConfigDict) -> PoolSettings:
    kind = c.kv_pool or ("ray" if c.backend == "ray" else "host")
    named = kind == "mooncake" and bool(c.mooncake_master)
    return PoolSettings(kind=kind, mooncake=mooncake_config(c) if named else None,
                        segment_mb=c.mooncake_segment_mb)
