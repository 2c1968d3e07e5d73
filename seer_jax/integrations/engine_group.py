"""Engines on mesh slices behind one small seam for trainers: `generate_groups` + `update_params`.

`EngineGroup` owns one `Engine` per mesh slice. A trainer hands it groups (a prompt and how many
samples it wants) and gets per-response tokens, logprobs, finish reason and the *policy version*
(how many weight syncs happened before the rollout started); `update_params` pushes new weights to
every slice (resharded device to device, see `weight_sync`) and bumps the version.

The seam: when the groups have one size, they go through the controller's rollout API
(`seer_jax.rollout.api.rollout_groups`) with the configured policy (divided rollout, context-aware
scheduling). Otherwise the group runs the engines directly: each group goes whole to the least
loaded slice (so its G samples share the prompt's KV pages) and the slices are stepped in turn.
Either way a request's samples depend only on its seed (`request_seed(seed, group, sample)`),
never on placement, so results are the same.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from seer_jax.engine.engine import Engine, EngineConfig
from seer_jax.errors import ConfigError, InputError, SeerError
from seer_jax.integrations.weight_sync import reshard_params
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params
from seer_jax.model.sharding import ShardingRules
from seer_jax.rollout.core.controller_config import request_seed
from seer_jax.rollout.core.types import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class GroupResponse:
    group_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"
    policy_version: int
    instance: int | None = None
    # [policy version, tokens] segments: the weights each run of tokens was generated under
    # (several with carry-over; else one, this rollout's version)
    weight_versions: list[list[int]] = dataclasses.field(default_factory=list)
    group_id: str = ""  # the group's id across carry-over calls
    # with SamplingParams.return_routed_experts: per token, per MoE layer, the expert ids routed
    # at the position that produced it
    routed_experts: list[list[list[int]]] | None = None


def detect_groups(prompts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Runs of identical consecutive prompts as (start, count): how Tunix lays out G samples."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prompts):
        if runs and list(prompts[runs[-1][0]]) == list(p):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def check_group_sizes(prompts: Sequence[Sequence[int]], group_sizes: Sequence[int]) -> None:
    """InputError unless there is one group size >= 1 per prompt."""
    if len(prompts) != len(group_sizes):
        raise InputError(f"{len(prompts)} prompts but {len(group_sizes)} group sizes")
    if any(g < 1 for g in group_sizes):
        raise InputError(f"group sizes must be >= 1, got {list(group_sizes)}")


def slice_meshes(devices: Sequence, num_instances: int, tp: int = 0) -> list[Mesh]:
    """num_instances 1-D `tp` meshes over consecutive devices (tp 0: all devices split evenly)."""
    devices = list(devices)
    if num_instances < 1:
        raise ConfigError(f"num_instances={num_instances}: allowed an integer >= 1")
    tp = tp or len(devices) // num_instances
    if tp < 1 or num_instances * tp > len(devices):
        raise ConfigError(
            f"num_instances={num_instances} x tp={tp} needs {num_instances * max(tp, 1)} devices; "
            f"the rollout mesh has {len(devices)}")
    return [Mesh(np.array(devices[i * tp:(i + 1) * tp]), ("tp",)) for i in range(num_instances)]


class EngineGroup:
    """One Engine per mesh slice, a policy version, and the trainer-facing seam."""

    def __init__(self, cfg: ModelConfig, params: Params, meshes: Sequence[Mesh],
                 engine_config: EngineConfig = EngineConfig(), eos_ids: tuple[int, ...] | None = None,
                 rules: ShardingRules = ShardingRules(), policy: str = "seer",
                 controller_config: dict[str, Any] | None = None, backend: str = "auto",
                 policy_options: dict[str, Any] | None = None):
        if backend not in ("auto", "engine", "api"):
            raise ConfigError(f"backend={backend!r}: allowed 'auto', 'engine', 'api'")
        if not meshes:
            raise ConfigError("EngineGroup needs at least one mesh slice")
        self.cfg = cfg
        self.meshes = list(meshes)
        self.rules = rules
        self.policy = policy
        self.controller_config = dict(controller_config or {})
        self.policy_options = dict(policy_options or {})
        self.backend = backend
        self.policy_version = 0
        self.engines = [
            Engine(cfg, reshard_params(params, m, cfg, rules), engine_config, mesh=m, eos_ids=eos_ids)
            for m in self.meshes
        ]
        self.last_backend: str | None = None
        self._instances = None  # EngineInstances over self.engines, for the controller API
        self.carry = None  # groups a partial rollout carries to the next (generate_groups_partial)

    # ------------------------------------------------------------------ weights
    def update_params(self, params: Params) -> int:
        """New weights on every slice (no host round trip); returns the new policy version.

        Cached prompt KV (the engines' prefix cache) was computed with the old weights, so it is
        dropped; a sync while requests are in flight would mix policies and is refused.
        """
        if any(e.has_unfinished() for e in self.engines):
            raise SeerError("update_params during a rollout: wait until generate_groups returns")
        for engine, mesh in zip(self.engines, self.meshes, strict=True):
            engine.update_params(reshard_params(params, mesh, self.cfg, self.rules))
            engine.blocks.clear_prefix_cache()
        self.policy_version += 1
        return self.policy_version

    def params(self, instance: int = 0) -> Params:
        """The parameters slice `instance` currently serves."""
        return self.engines[instance].runner.stacked_params()

    # ------------------------------------------------------------------ rollout
    def generate_groups(self, prompts: Sequence[Sequence[int]], group_sizes: Sequence[int],
                        sampling: SamplingParams, max_tokens: int, seed: int = 0) -> list[GroupResponse]:
        """Sample prompt g group_sizes[g] times; responses in (group, sample) order.

        The seed of sample s of group g is `request_seed(seed, g, s)` (sampling.seed is ignored).
        """
        check_group_sizes(prompts, group_sizes)
        if not prompts:
            return []
        version = self.policy_version
        api_out = self._via_api(prompts, group_sizes, sampling, max_tokens, seed, version)
        if api_out is not None:
            self.last_backend = "api"
            return api_out
        self.last_backend = "engine"
        return self._via_engines(prompts, group_sizes, sampling, max_tokens, seed, version)

    def generate_groups_partial(self, prompts: Sequence[Sequence[int]], group_size: int,
                                sampling: SamplingParams, max_tokens: int, target_groups: int,
                                seed: int = 0) -> list[GroupResponse]:
        """Partial rollout: start these groups and return once `target_groups` groups are
        complete, counting groups carried from earlier calls; the unfinished ones carry into the
        next call (their KV stays in the pool while the weights do not change). The groups
        returned are not necessarily this call's: each response names its `group_id` and
        `prompt_ids`, and records the policy versions its tokens were generated under. With no
        prompts and `target_groups` 0, the carried groups are run to completion (a drain).
        `group_index` is the group's index in this call's prompts, -1 for a carried group."""
        from seer_jax.rollout.core.carry import CarryOver

        if self.carry is None:
            self.carry = CarryOver()
        n = len(prompts) + len(self.carry)
        if n == 0:
            return []
        if not prompts:  # a drain: the carried groups keep their own size
            group_size = len(self.carry.groups[0].records)
        check_group_sizes(prompts, [group_size] * len(prompts))
        version = self.policy_version
        ids = self.carry.new_group_ids(len(prompts))
        out = self._controller_rollout(prompts, group_size, sampling, max_tokens, seed,
                                       carry=self.carry, target_groups=target_groups or None,
                                       weight_version=version)
        index = {gid: g for g, gid in enumerate(ids)}
        self.last_backend = "api"
        return [GroupResponse(index.get(r.group_id, -1), r.sample_index, list(r.prompt_ids),
                              list(r.token_ids), list(r.logprobs), r.finish_reason, version,
                              r.instances[-1] if r.instances else None,
                              [list(s) for s in r.weight_versions], r.group_id, r.routed_experts)
                for r in out.results]

    def _controller_rollout(self, prompts, group_size, sampling, max_tokens, seed, **kw):
        if self._instances is None:
            from seer_jax.rollout.backends.engine_instance import EngineInstance
            from seer_jax.rollout.backends.kv_pool import HostKVPool

            pool = HostKVPool()
            self._instances = [EngineInstance(i, e, pool) for i, e in enumerate(self.engines)]
        from seer_jax.rollout.api import rollout_groups

        return rollout_groups(self._instances, [list(p) for p in prompts], group_size, max_tokens,
                              dataclasses.replace(sampling, seed=seed), policy=self.policy,
                              config={"chunk_size": max_tokens, **self.controller_config},
                              policy_options=self.policy_options, **kw)

    def _via_engines(self, prompts, group_sizes, sampling, max_tokens, seed, version):
        load = [0] * len(self.engines)
        where: dict[str, tuple[int, int, int]] = {}
        for g, (prompt, size) in enumerate(zip(prompts, group_sizes, strict=True)):
            i = min(range(len(self.engines)), key=lambda j: load[j])
            load[i] += size
            for s in range(size):
                rid = f"{g}/{s}"
                sp = dataclasses.replace(sampling, seed=request_seed(seed, g, s))
                self.engines[i].add_request(rid, list(prompt), max_tokens, sp)
                where[rid] = (g, s, i)
        outs = {}
        while any(e.has_unfinished() for e in self.engines):
            for e in self.engines:
                if e.has_unfinished():
                    for r in e.step():
                        outs[r.request_id] = r
        result = []
        for rid, (g, s, i) in where.items():
            r = outs[rid]
            result.append(GroupResponse(g, s, list(prompts[g]), list(r.token_ids), list(r.logprobs),
                                        r.finish_reason, version, i,
                                        routed_experts=r.routed_experts))
        return result

    def _via_api(self, prompts, group_sizes, sampling, max_tokens, seed, version):
        """The controller's rollout API (`seer_jax.rollout.api.rollout_groups`) with the configured
        policy, when present and the groups have one size; None to run the engines directly."""
        if self.backend == "engine" or len(set(group_sizes)) != 1:
            if self.backend == "api":
                raise ConfigError("backend='api' needs groups of one size, got "
                                  f"{sorted(set(group_sizes))}")
            return None
        out = self._controller_rollout(prompts, group_sizes[0], sampling, max_tokens, seed,
                                       weight_version=version)
        return [GroupResponse(r.group_index, r.sample_index, list(r.prompt_ids), list(r.token_ids),
                              list(r.logprobs), r.finish_reason, version,
                              r.instances[-1] if r.instances else None,
                              [list(s) for s in r.weight_versions], r.group_id, r.routed_experts)
                for r in out.results]


def default_meshes(num_instances: int = 1, tp: int = 0) -> list[Mesh]:
    return slice_meshes(jax.devices(), num_instances, tp)
