"""The trainer seam (`generate_groups` + `update_params`, as `EngineGroup`) over Ray actors.

`RayEngineGroup` starts one engine actor per mesh slice (`seer_jax.rollout.backends.ray_group`) and runs
every rollout through the controller with the `concurrent` driver (every actor with work steps at
once), the KV of chunks that move between actors going through the object-store pool. Weights go
to the actors through the object store: put once as host arrays, applied by every actor between
rollouts (`RayInstanceGroup.update_params`), so every response of a rollout comes from one
version. The actors live as long as the group; `shutdown()` ends them.

A request's samples depend only on its seed (`request_seed(seed, group, sample)`), so the
responses equal those of the in-process `EngineGroup` for the same prompts and seed. Groups of
different sizes (a prompt repeated in consecutive groups) run at the largest size and the extra
samples are dropped, which keeps every kept sample's seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from seer_jax.engine.engine import EngineConfig
from seer_jax.integrations.engine_group import GroupResponse, check_group_sizes
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.core.types import SamplingParams


class RayEngineGroup:
    """One Ray engine actor per slice, a policy version, and the trainer-facing seam."""

    def __init__(self, cfg: ModelConfig, params: Params, *, num_instances: int, tp: int,
                 engine_config: EngineConfig, eos_ids: tuple[int, ...] | None = None,
                 policy: str = "seer", controller_config: dict[str, Any] | None = None,
                 policy_options: dict[str, Any] | None = None,
                 ray_backend: RayBackendConfig | None = None, draft_service: Any = None):
        """draft_service: the `SyncConfig` of the draft service when engine_config.speculation
        is on (default: one shard, one step stale)."""
        from seer_jax.rollout.backends.ray_group import make_ray_instances

        self.cfg = cfg
        self.policy = policy
        self.controller_config = dict(controller_config or {})
        self.policy_options = dict(policy_options or {})
        self.policy_version = 0
        self.last_backend: str | None = None
        self._rollouts = 0
        self._host = _host_params(params)
        self.actors = make_ray_instances(cfg, self._host, num_instances=num_instances, tp=max(tp, 1),
                                         engine_config=engine_config, backend=ray_backend,
                                         dtype=cfg.dtype, eos_ids=eos_ids,
                                         draft_service=draft_service)

    # ------------------------------------------------------------------ weights
    def update_params(self, params: Params) -> int:
        """New weights on every actor (through the object store); returns the new version."""
        host = _host_params(params)
        self.actors.update_params(host, self.policy_version + 1)
        self._host = host
        self.policy_version += 1
        return self.policy_version

    def params(self, instance: int = 0) -> Params:
        """The parameters every actor serves, as host arrays."""
        return self._host

    # ------------------------------------------------------------------ rollout
    def generate_groups(self, prompts: Sequence[Sequence[int]], group_sizes: Sequence[int],
                        sampling: SamplingParams, max_tokens: int, seed: int = 0) -> list[GroupResponse]:
        """Sample prompt g group_sizes[g] times; responses in (group, sample) order."""
        from seer_jax.rollout.core.run import rollout

        check_group_sizes(prompts, group_sizes)
        if not prompts:
            return []
        version = self.policy_version
        if self.actors.lost:  # refused with fewer slices than configured unless allowed
            self.actors.reset()
        group_ids = None
        if self.actors.draft is not None:
            # grouped speculation: the draft service forgets the last rollout's groups, and
            # this rollout's group ids are its own (a late append of the last one lands apart)
            self.actors.draft.new_rollout()
            group_ids = [f"r{self._rollouts}/g{i}" for i in range(len(prompts))]
        self._rollouts += 1
        out = rollout([list(p) for p in prompts], group_size=max(group_sizes), max_tokens=max_tokens,
                      instances=self.actors.instances, sampling=dataclasses.replace(sampling, seed=seed),
                      policy=self.policy, pool=self.actors.pool, group_ids=group_ids,
                      config={"chunk_size": max_tokens, **self.controller_config},
                      clock="concurrent", policy_options=self.policy_options,
                      configured_instances=self.actors.num_slices)
        self.last_backend = "ray"
        return [GroupResponse(r.group_index, r.sample_index, list(r.prompt_ids), list(r.token_ids),
                              list(r.logprobs), r.finish_reason, version,
                              r.instances[-1] if r.instances else None,
                              routed_experts=r.routed_experts)
                for r in out.results if r.sample_index < group_sizes[r.group_index]]

    def shutdown(self) -> None:
        self.actors.shutdown()


def _host_params(params: Params) -> Params:
    """Host numpy copies (what the object store holds). Tunix syncs weights under a transfer
    guard on CPU; reaching the actors needs the host copy, so it is allowed here."""
    from seer_jax.rollout.backends.ray_actor import numpy_params

    with jax.transfer_guard("allow"):
        return numpy_params(params)
