"""Tunix adapter: our engine as a `tunix.rl.rollout.base_rollout.BaseRollout`.

Use it as `ClusterConfig(rollout_engine=functools.partial(SeerRollout, num_instances=..., ...))`;
Tunix constructs it as `engine(rollout_actor=, tokenizer=, mesh=, rollout_config=)`.

- `generate`: tokenizes like Tunix's vanilla sampler (BOS when the tokenizer has one), finds the
  groups (Tunix repeats each prompt G times consecutively) and runs them through
  `EngineGroup.generate_groups` (controller API with the configured policy when present, else the
  engines directly). Returns completions without the final EOS (as Tunix's sampler does), prompts
  left-padded to `max_prompt_length` (or the next power of two above the longest prompt), and
  per-token logprobs under the sampling distribution (temperature, top-k, top-p).
- `get_per_token_logps`: the recorded rollout logprobs when (prompt, completion) is one we just
  generated at the current weights, else a forward pass under the same distribution.
- `update_params`: Tunix's nnx state -> LoRA adapters merged (`lora`) -> our param dict (a Tunix
  Llama3/Qwen2/Qwen3 actor is mapped by `tunix_models`, `TunixLlama` is ours already) -> every
  engine slice, device to device (Tunix runs this under a transfer guard that forbids host round
  trips on CPU); with `backend="ray"`, through the object store to the engine actors.
- Routed experts: with an engine built with `return_routed_experts=True` (a mixture-of-experts
  policy), `generate` returns a `SeerRolloutOutput` whose `routed_experts[i]` is an int32
  array [len(tokens[i]) (+1 when the final EOS was dropped), MoE layers, k]: row j holds the
  experts the router chose at the position that produced generated token j (prompt length - 1
  + j), so a trainer can replay the rollout's routing (also `last_routed_experts`).
- `model()`: for `TunixLlama` actors an NNX module holding the weights slice 0 serves; for Tunix
  model classes a shape-only copy of the actor. Either way Tunix's `is_sharing_weights` check sees
  that the rollout does not share the actor's weights, so it syncs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tunix.rl.rollout import base_rollout

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError
from seer_jax.integrations.engine_group import (
    EngineGroup,
    GroupResponse,
    detect_groups,
    slice_meshes,
)
from seer_jax.integrations.lora import has_lora, lora_scale_fn, merge_lora
from seer_jax.integrations.nnx_actor import TunixLlama, completion_logprobs
from seer_jax.integrations.tunix_models import family_of, model_config_from_tunix
from seer_jax.integrations.weight_sync import ParamMapping, state_to_params
from seer_jax.model.config import ModelConfig
from seer_jax.model.sharding import ShardingRules
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.core.types import SamplingParams


@dataclasses.dataclass
class SeerRolloutOutput(base_rollout.RolloutOutput):
    """Tunix's RolloutOutput plus, with routed experts on, each completion's routing."""

    routed_experts: list[np.ndarray] | None = None


# auto/engine/api: engines in this process (see EngineGroup); ray: one Ray actor per slice
BACKENDS = ("auto", "engine", "api", "ray")


class SeerRollout(base_rollout.BaseRollout):
    """seer_jax engines (one per mesh slice) behind Tunix's rollout interface."""

    def __init__(self, rollout_actor: nnx.Module, tokenizer: Any, mesh: Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, *,
                 model_config: ModelConfig | None = None, num_instances: int = 0, tp: int = 0,
                 engine_config: EngineConfig | None = None, policy: str = "seer",
                 controller_config: dict[str, Any] | None = None, backend: str = "auto",
                 policy_options: dict[str, Any] | None = None,
                 param_mapping: ParamMapping | None = None, rules: ShardingRules = ShardingRules(),
                 lora_alpha: float | None = None, ray_backend: RayBackendConfig | None = None,
                 draft_service: Any = None):
        if backend not in BACKENDS:
            raise ConfigError(f"backend={backend!r}: allowed {list(BACKENDS)}")
        family = family_of(rollout_actor)
        cfg = model_config
        if cfg is None and family is not None:
            cfg = model_config_from_tunix(rollout_actor, family)
        cfg = cfg or getattr(rollout_actor, "cfg", None)
        if not isinstance(cfg, ModelConfig):
            raise ConfigError("SeerRollout needs model_config= unless the actor is a TunixLlama/Llama "
                              "or a Tunix Llama3/Qwen2/Qwen3 model")
        if param_mapping is None and family is not None:
            param_mapping = family.mapping
        rc = rollout_config
        # RolloutConfig's parallelism and dtype apply unless given here: data_parallel_size engine
        # replicas of tensor_parallel_size devices each.
        if not num_instances:
            num_instances = rc.data_parallel_size if rc is not None and rc.data_parallel_size > 0 else 1
        if not tp and rc is not None and rc.tensor_parallel_size > 0:
            tp = rc.tensor_parallel_size
        if rc is not None and rc.data_type is not None:
            dtype = jnp.dtype(rc.data_type).name
            if dtype not in ("float32", "bfloat16"):
                raise ConfigError(f"rollout_config.data_type={dtype!r}: allowed float32, bfloat16")
            cfg = cfg.with_dtype(dtype)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.mesh = mesh
        self.rollout_config = rollout_config
        self.param_mapping = param_mapping
        # LoRA (qwix): adapters are merged into the base weights on every sync; under LoRA Tunix
        # syncs only the adapters, so the frozen base weights are kept (references, not copies)
        state = nnx.to_pure_dict(nnx.state(rollout_actor, nnx.Param))
        self._lora_base: dict[str, Any] | None = None
        self._lora_scale = None
        if has_lora(state):
            self._lora_scale = lora_scale_fn(rollout_actor, lora_alpha)
            self._lora_base = nnx.to_pure_dict(
                nnx.state(rollout_actor, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
        params = self._trainer_params(state)
        eos = self.eos_id()
        eos_ids = (eos,) if eos is not None else None
        engine_config = engine_config or EngineConfig(kv_memory_gib=0.25)
        if backend == "ray":
            from seer_jax.integrations.ray_group import RayEngineGroup

            self.group = RayEngineGroup(cfg, params, num_instances=num_instances, tp=tp,
                                        engine_config=engine_config, eos_ids=eos_ids,
                                        policy=policy, controller_config=controller_config,
                                        policy_options=policy_options, ray_backend=ray_backend,
                                        draft_service=draft_service)
        else:
            devices = list(mesh.devices.flat) if mesh is not None and not mesh.empty else jax.devices()
            meshes = slice_meshes(devices, num_instances, tp)
            self.group = EngineGroup(cfg, params, meshes, engine_config, eos_ids=eos_ids, rules=rules,
                                     policy=policy, controller_config=controller_config,
                                     backend=backend, policy_options=policy_options)
        if family is not None:
            # Tunix compares the rollout model's state with the actor's leaf by leaf
            # (`is_sharing_weights`, which needs the same tree): a shape-only copy of the actor
            self._model: nnx.Module = nnx.eval_shape(lambda: nnx.clone(rollout_actor))
        else:
            self._model = TunixLlama.from_params(cfg, self.group.params(0))
        self._seed_counter = 0
        self._recorded: dict[tuple, list[tuple[tuple[int, ...], list[float]]]] = {}
        self._recorded_version = -1
        self._last_sampling = SamplingParams(temperature=1.0)
        self.last_responses: list[GroupResponse] = []
        self.return_routed_experts = engine_config.return_routed_experts
        self.last_routed_experts: list[np.ndarray] | None = None

    # ------------------------------------------------------------------ Tunix interface
    def generate(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        prompt_ids = [self._tokenize(p) for p in prompts]
        runs = detect_groups(prompt_ids)
        sampling = sampling_from_config(rollout_config)
        seed = self._next_seed(rollout_config.seed)
        stop = {int(t) for t in (rollout_config.eos_tokens or [self.eos_id()]) if t is not None}
        sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sorted(stop)),
                                       return_routed_experts=self.return_routed_experts)
        responses = self.group.generate_groups([prompt_ids[s] for s, _ in runs],
                                               [n for _, n in runs], sampling,
                                               rollout_config.max_tokens_to_generate, seed)
        self.last_responses = responses
        self._last_sampling = sampling
        tokens, logprobs = [], []
        self._recorded = {}
        self._recorded_version = self.group.policy_version
        for r in responses:
            toks, lps = list(r.token_ids), list(r.logprobs)
            if toks and toks[-1] in stop and r.finish_reason in ("eos", "stop"):
                toks, lps = toks[:-1], lps[:-1]
            tokens.append(np.asarray(toks, np.int32))
            logprobs.append(np.asarray(lps, np.float32))
            self._recorded.setdefault(tuple(r.prompt_ids), []).append((tuple(toks), lps))
        longest = max(len(p) for p in prompt_ids)
        width = rollout_config.max_prompt_length
        if width < longest:
            width = 1 << math.ceil(math.log2(longest))
        padded = np.full((len(prompt_ids), width), self.pad_id(), np.int32)
        for i, p in enumerate(prompt_ids):
            padded[i, width - len(p):] = p
        self.last_routed_experts = None
        if self.return_routed_experts:
            self.last_routed_experts = [np.asarray(r.routed_experts, np.int32) for r in responses]
        return SeerRolloutOutput(
            text=[self.tokenizer.decode(t.tolist()) for t in tokens],
            logits=None,
            tokens=tokens,
            left_padded_prompt_tokens=padded,
            logprobs=logprobs if rollout_config.return_logprobs else None,
            routed_experts=self.last_routed_experts,
        )

    def generate_partial(self, prompts: list[str], rollout_config: base_rollout.RolloutConfig,
                         target_groups: int) -> list[GroupResponse]:
        """Partial rollout across iterations (off unless called; `generate` stays on-policy).

        Starts these prompts' groups (laid out as for `generate`: each prompt repeated G times)
        and returns once `target_groups` groups are complete, counting groups carried from
        earlier calls; the others carry into the next call, keeping their tokens (and their KV
        while no `update_params` happened in between). Returns whole groups as `GroupResponse`s
        (tokens with the final EOS, logprobs, `prompt_ids`, `group_id`, and `weight_versions`:
        [policy version, tokens] segments), which may include groups of earlier calls: a trainer
        using it matches rewards by `prompt_ids`/`group_id`, not by position. `target_groups` 0
        with no prompts runs every carried group to completion. Needs an in-process backend."""
        if not hasattr(self.group, "generate_groups_partial"):
            raise ConfigError("generate_partial needs backend 'auto', 'engine' or 'api' (in "
                              "process); backend='ray' has no carry-over")
        prompt_ids = [self._tokenize(p) for p in prompts]
        runs = detect_groups(prompt_ids)
        sizes = {n for _, n in runs}
        if len(sizes) > 1:
            raise ConfigError(f"generate_partial needs groups of one size, got {sorted(sizes)}")
        sampling = sampling_from_config(rollout_config)
        stop = {int(t) for t in (rollout_config.eos_tokens or [self.eos_id()]) if t is not None}
        sampling = dataclasses.replace(sampling, stop_token_ids=tuple(sorted(stop)),
                                       return_routed_experts=self.return_routed_experts)
        responses = self.group.generate_groups_partial(
            [prompt_ids[s] for s, _ in runs], sizes.pop() if sizes else 1, sampling,
            rollout_config.max_tokens_to_generate, target_groups,
            self._next_seed(rollout_config.seed))
        self.last_responses = responses
        self._last_sampling = sampling
        self._recorded = {}
        self._recorded_version = self.group.policy_version
        for r in responses:  # only responses generated wholly under the current weights
            if all(v == self._recorded_version for v, _ in r.weight_versions):
                toks, lps = list(r.token_ids), list(r.logprobs)
                if toks and toks[-1] in stop and r.finish_reason in ("eos", "stop"):
                    toks, lps = toks[:-1], lps[:-1]
                self._recorded.setdefault(tuple(r.prompt_ids), []).append((tuple(toks), lps))
        return responses

    @property
    def carried_groups(self) -> int:
        """Groups a partial rollout (`generate_partial`) holds for the next call."""
        carry = getattr(self.group, "carry", None)
        return 0 if carry is None else len(carry)

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        prompt = np.asarray(prompt_tokens, np.int32)
        completion = np.asarray(completion_tokens, np.int32)
        recorded = self.recorded_logps(prompt, completion)
        if recorded is not None:
            return jnp.asarray(recorded)
        return self.forward_logps(prompt, completion)

    def recorded_logps(self, prompt_bp: np.ndarray, completion_bc: np.ndarray) -> np.ndarray | None:
        """The rollout's own logprobs for every row, or None if any row is not a fresh rollout."""
        if self._recorded_version != self.group.policy_version:
            return None
        pad = self.pad_id()
        B, C = completion_bc.shape
        out = np.zeros((B, C), np.float32)
        for b in range(B):
            row = prompt_bp[b]
            start = int(np.argmax(row != pad)) if np.any(row != pad) else len(row)
            found = None
            for toks, lps in self._recorded.get(tuple(row[start:].tolist()), []):
                if len(toks) <= C and list(toks) + [pad] * (C - len(toks)) == completion_bc[b].tolist():
                    found = lps
                    break
            if found is None:
                return None
            out[b, :len(found)] = found
        return out

    def forward_logps(self, prompt_bp: np.ndarray, completion_bc: np.ndarray) -> jax.Array:
        """Completion logprobs by a forward pass at the weights slice 0 serves."""
        pad = self.pad_id()
        prompt_bp = np.asarray(prompt_bp, np.int32)
        completion_bc = np.asarray(completion_bc, np.int32)
        valid = np.concatenate([prompt_bp != pad, completion_bc != pad], axis=1)
        B = prompt_bp.shape[0]
        s = self._last_sampling
        return completion_logprobs(
            self.group.params(0), self.cfg, jnp.asarray(prompt_bp), jnp.asarray(completion_bc),
            jnp.asarray(valid), jnp.full((B,), s.temperature, jnp.float32),
            jnp.full((B,), s.top_p, jnp.float32), jnp.full((B,), s.top_k, jnp.int32))

    def update_params(self, params: Any, filter_types: tuple[Any, ...] | None = None) -> None:
        state = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
        lora_only = filter_types is not None and any(
            getattr(t, "__name__", "") == "LoRAParam" for t in filter_types)
        if lora_only and not has_lora(state):
            raise ConfigError("update_params(filter_types=LoRAParam) got no LoRA adapters "
                              "(no *_lora_a/*_lora_b parameters)")
        self.group.update_params(self._trainer_params(state))
        if isinstance(self._model, TunixLlama):
            self._model.set_params(self.group.params(0))

    def _trainer_params(self, state: Any) -> Any:
        """Our param dict from the trainer's state: LoRA adapters merged, names mapped."""
        if has_lora(state):
            if self._lora_scale is None:
                raise ConfigError("the synced state has LoRA adapters but the rollout actor had "
                                  "none when SeerRollout was built")
            state = merge_lora(state, self._lora_scale, base=self._lora_base)
        return state_to_params(state, self.cfg, self.param_mapping)

    def shutdown(self) -> None:
        """End the engine actors (backend='ray'); nothing to do in process."""
        if hasattr(self.group, "shutdown"):
            self.group.shutdown()

    @property
    def policy_version(self) -> int:
        return self.group.policy_version

    def set_policy_version(self, version: int) -> None:
        """Number the served weights `version` (a resumed job: the restored trainer step)."""
        if version < 0:
            raise ConfigError(f"policy version {version}: must be >= 0")
        self.group.policy_version = int(version)

    def model(self) -> nnx.Module:
        return self._model

    def pad_id(self) -> int:
        return _call(self.tokenizer, "pad_id")

    def eos_id(self) -> int:
        return _call(self.tokenizer, "eos_id")

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, text: str) -> list[int]:
        ids = [int(t) for t in self.tokenizer.encode(text)]
        bos = _call(self.tokenizer, "bos_id")
        if bos:
            ids = [bos] + ids
            while len(ids) > 1 and ids[0] == ids[1] == bos:
                ids = ids[1:]
        if not ids:
            raise ConfigError(f"prompt {text!r} tokenizes to nothing")
        return ids

    def _next_seed(self, seed: Any) -> int:
        if seed is not None:
            return int(np.asarray(seed).reshape(-1)[-1]) & 0x7FFFFFFF
        self._seed_counter += 1
        return self._seed_counter


def sampling_from_config(rc: base_rollout.RolloutConfig) -> SamplingParams:
    """Our SamplingParams from Tunix's RolloutConfig (top_k None/-1 = off, top_p None = 1)."""
    top_k = rc.top_k if rc.top_k is not None and rc.top_k > 0 else 0
    top_p = 1.0 if rc.top_p is None else float(rc.top_p)
    return SamplingParams(temperature=float(rc.temperature), top_p=top_p, top_k=int(top_k))


def _call(tok: Any, name: str):
    attr = getattr(tok, name, None)
    return attr() if callable(attr) else attr


class CharTokenizer:
    """A character-level tokenizer over printable ASCII (id = code point) for tiny models.

    pad 0, bos 1, eos 2; characters outside ASCII 32..126 and newline are dropped. Vocab 128.
    It has the `encode/decode/bos_id/eos_id/pad_id` methods Tunix's TokenizerAdapter accepts.
    """

    vocab_size = 128

    def encode(self, text: str, **_: Any) -> list[int]:
        return [ord(c) for c in text if c == "\n" or 32 <= ord(c) < 127]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return "".join(chr(i) for i in ids if i == 10 or 32 <= i < 127)

    def bos_id(self) -> int:
        return 1

    def eos_id(self) -> int:
        return 2

    def pad_id(self) -> int:
        return 0


class TunixTokenizer:
    """Our `seer_jax.model.tokenizer.Tokenizer` with the methods Tunix's TokenizerAdapter calls.

    `bos_id()` is None unless the model adds a BOS token (the rollout prepends it, as Tunix's own
    sampler does), so SmolLM2 prompts get none.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str, **_: Any) -> list[int]:
        return self.tokenizer.encode(str(text), add_bos=False)

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id if self.tokenizer.add_bos_token else None

    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def pad_id(self) -> int:
        return self.tokenizer.pad_id
