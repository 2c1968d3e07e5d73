"""Mixture-of-experts MLP configuration, and its mapping from Hugging Face `config.json` fields.

One `MoeConfig` covers the routers we serve:
  softmax top-k (Qwen3-MoE, Qwen2-MoE, Mixtral): probabilities over all experts, the k largest,
    renormalised to sum 1 when `norm_topk_prob` (Mixtral always);
  (DeepSeek-V2: softmax top-k times routed_scaling_factor);
  sigmoid, group-limited (DeepSeek-V3, Kimi-K2, Moonlight): per-expert sigmoid scores; the choice
    adds `e_score_correction_bias` and keeps only the `topk_group` best of `n_group` expert groups
    (a group scored by its two best experts); the weights are the chosen experts' unbiased scores,
    renormalised when `norm_topk_prob`, times `routed_scaling_factor`.
Shared experts: an always-on MLP of `shared_intermediate_size` added to the routed output, behind a
sigmoid gate (`shared_gate`, Qwen2-MoE) or not (DeepSeek-V3). Layers in `dense_layers` keep a dense
MLP. A variant outside this (another router, a biased or clamped expert MLP) is refused with a
`ConfigError` naming the architecture and the field, never loaded wrongly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seer_jax.errors import ConfigError

SCORING = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def validate(self, num_layers: int) -> None:
        for key in ("num_experts", "num_experts_per_tok", "expert_intermediate_size", "n_group",
                    "topk_group"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"moe config {key}={value!r}: must be a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"moe config num_experts_per_tok={self.num_experts_per_tok} exceeds "
                              f"num_experts={self.num_experts}")
        if self.scoring not in SCORING:
            raise ConfigError(f"moe config scoring={self.scoring!r}: allowed {SCORING}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"moe config n_group={self.n_group}, topk_group={self.topk_group}: "
                              f"n_group must divide num_experts={self.num_experts} and "
                              "topk_group <= n_group")
        if self.n_group > 1 and (self.scoring != "sigmoid" or self.num_experts // self.n_group < 2):
            raise ConfigError(f"moe config n_group={self.n_group}: group-limited routing needs "
                              "sigmoid scoring and at least 2 experts per group")
        if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
            raise ConfigError(f"moe config topk_group={self.topk_group}: the chosen groups hold "
                              f"fewer than num_experts_per_tok={self.num_experts_per_tok} experts")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ConfigError("moe config shared_gate=True needs shared_intermediate_size > 0")
        bad = [i for i in self.dense_layers if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"moe config dense_layers {bad}: not layers of a {num_layers}-layer model")

    def num_params(self, hidden_size: int, active: bool = False) -> int:
        """Parameters of one MoE MLP (all experts, or the `active` ones a token uses)."""
        d = hidden_size
        experts = self.num_experts_per_tok if active else self.num_experts
        n = d * self.num_experts + experts * 3 * d * self.expert_intermediate_size
        n += 3 * d * self.shared_intermediate_size + (d if self.shared_gate else 0)
        return n + (self.num_experts if self.score_correction_bias else 0)


# MoE architectures we know and do not serve: the field that shows what we lack
_UNSUPPORTED = {
    "GptOssForCausalLM": ("num_local_experts", "GPT-OSS experts (biased, clamped SwiGLU, "
                          "attention sinks)"),
    "Llama4ForCausalLM": ("num_local_experts", "Llama 4 experts (sigmoid top-1 with a shared "
                          "expert on interleaved layers, chunked attention)"),
    "Llama4ForConditionalGeneration": ("text_config", "Llama 4"),
}


def refuse_unsupported_moe(arch: str, hf: dict[str, Any]) -> None:
    if arch in _UNSUPPORTED:
        field, what = _UNSUPPORTED[arch]
        raise ConfigError(f"config.json architecture {arch!r}: {field}={hf.get(field)!r} needs "
                          f"{what}, which seer_jax does not serve")


def _refuse(arch: str, field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config.json architecture {arch!r}: {field}={value!r} is not supported "
                      f"(supported: {allowed})")


def _int_list(hf: dict[str, Any], key: str) -> tuple[int, ...]:
    return tuple(int(i) for i in (hf.get(key) or ()))


def moe_config_from_hf(arch: str, hf: dict[str, Any]) -> MoeConfig:
    """The MoE block of a Qwen3-MoE, Qwen2-MoE or Mixtral `config.json`."""
    L = int(hf["num_hidden_layers"])
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if num_experts < 1:
        _refuse(arch, "num_experts", num_experts, "a positive number of experts")
    if arch == "MixtralForCausalLM":
        if hf.get("sliding_window") is not None:
            _refuse(arch, "sliding_window", hf["sliding_window"], "null")
        return MoeConfig(num_experts=num_experts,
                         num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
                         expert_intermediate_size=int(hf["intermediate_size"]),
                         norm_topk_prob=True)
    if hf.get("use_sliding_window"):
        _refuse(arch, "use_sliding_window", True, "false")
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    only_mlp = set(_int_list(hf, "mlp_only_layers"))
    dense = tuple(i for i in range(L) if i in only_mlp or (i + 1) % step)
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(num_experts=num_experts,
                     num_experts_per_tok=int(hf["num_experts_per_tok"]),
                     expert_intermediate_size=int(hf["moe_intermediate_size"]),
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     shared_intermediate_size=shared, shared_gate=shared > 0,
                     dense_layers=dense)


def deepseek_v3_moe_config(hf: dict[str, Any]) -> MoeConfig:
    """The MoE block of a DeepSeek-V3 `config.json` (DeepSeek-V3/R1, Kimi-K2, Moonlight)."""
    arch = (hf.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse(arch, "topk_method", hf["topk_method"], "'noaux_tc'")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        _refuse(arch, "scoring_func", hf["scoring_func"], "'sigmoid'")
    if hf.get("ep_size", 1) != 1:
        _refuse(arch, "ep_size", hf["ep_size"], "1")
    L = int(hf["num_hidden_layers"])
    first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
    step = int(hf.get("moe_layer_freq", 1) or 1)
    expert_f = int(hf["moe_intermediate_size"])
    num_experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    return MoeConfig(num_experts=num_experts,
                     num_experts_per_tok=int(hf["num_experts_per_tok"]),
                     expert_intermediate_size=expert_f,
                     scoring="sigmoid",
                     norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                     score_correction_bias=True,
                     n_group=int(hf.get("n_group", 1) or 1),
                     topk_group=int(hf.get("topk_group", 1) or 1),
                     shared_intermediate_size=expert_f * int(hf.get("n_shared_experts", 0) or 0),
                     dense_layers=tuple(i for i in range(L) if i < first_dense or i % step))


def deepseek_v2_moe_config(hf: dict[str, Any]) -> MoeConfig:
    """The MoE block of a DeepSeek-V2 `config.json` (DeepSeek-V2-Lite, DeepSeek-Coder-V2-Lite):
    softmax over all experts, the k largest (`topk_method: greedy`), times
    `routed_scaling_factor`."""
    arch = (hf.get("architectures") or ["DeepseekV2ForCausalLM"])[0]
    method = hf.get("topk_method", "greedy")
    if method != "greedy" and not (method == "group_limited_greedy"
                                   and int(hf.get("n_group") or 1) == 1):
        _refuse(arch, "topk_method", method, "'greedy'")
    if hf.get("scoring_func", "softmax") != "softmax":
        _refuse(arch, "scoring_func", hf["scoring_func"], "'softmax'")
    L = int(hf["num_hidden_layers"])
    first_dense = int(hf.get("first_k_dense_replace", 0) or 0)
    expert_f = int(hf["moe_intermediate_size"])
    return MoeConfig(num_experts=int(hf.get("n_routed_experts") or 0),
                     num_experts_per_tok=int(hf["num_experts_per_tok"]),
                     expert_intermediate_size=expert_f,
                     norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                     routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                     shared_intermediate_size=expert_f * int(hf.get("n_shared_experts", 0) or 0),
                     dense_layers=tuple(range(min(first_dense, L))))
