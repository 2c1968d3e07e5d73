"""Tunix's own decoders (`tunix.models.llama3`, `qwen2`, `qwen3`, Qwen3 MoE) as rollout actors.

When the actor a Tunix `RLCluster` trains is one of these classes, `SeerRollout` finds its family
by class (`family_of`), builds our `ModelConfig` from the Tunix model's config
(`model_config_from_tunix`) and maps its parameters to ours on every sync (`family.mapping`), so
no `model_config=` or `param_mapping=` is needed.

Tunix's parameter layout (nnx pure dict, per layer under `layers/<i>/`):

| Tunix                                   | shape                  | ours (stacked on layers)   |
|-----------------------------------------|------------------------|----------------------------|
| `embedder/input_embedding`              | [vocab, d]             | `embed`                    |
| `attn/q_proj/w`, `k_proj/w`, `v_proj/w` | [d, heads, head_dim]   | `wq`, `wk`, `wv` [d, h*D]  |
| `attn/o_proj/w`                         | [heads, head_dim, d]   | `wo` [h*D, d]              |
| `attn/q_bias`, `k_bias`, `v_bias` (qwen2) | [h*D]                | `bq`, `bk`, `bv`           |
| `attn/q_norm/w`, `k_norm/w` (qwen3)     | [head_dim]             | `q_norm`, `k_norm`         |
| `mlp/gate_proj/kernel`, `up_proj`, `down_proj` | [d, f], [f, d]  | `w_gate`, `w_up`, `w_down` |
| `input_layernorm/w`, `post_attention_layernorm/w` | [d]          | `attn_norm`, `mlp_norm`    |
| `final_norm/w`, `lm_head/w` (untied)    | [d], [d, vocab]        | `final_norm`, `lm_head`    |
| `mlp/router/kernel` (qwen3 MoE)         | [d, experts]           | `router`                   |
| `mlp/gate_proj`, `up_proj` (qwen3 MoE)  | [experts, d, f]        | `we_gate`, `we_up`         |
| `mlp/down_proj` (qwen3 MoE)             | [experts, f, d]        | `we_down`                  |

All three rotate the two halves of each head (HF `rotate_half`), as we do. RoPE base: tunix
0.1.7's Llama3 and Qwen3 attention call `apply_rope` without the config's `rope_theta`, so they
rotate with that function's default (1e6) whatever the config says; `applied_rope_theta` reads
which base the installed module applies, so the rollout samples from the policy the trainer
actually computes.

Qwen3 mixture of experts (`ModelConfig.num_experts` set, e.g. `qwen3_30b_a3b`): every layer's MLP
is a `MoELayer` (softmax over the experts, top `num_experts_per_tok`, the weights renormalised to
sum 1; no shared expert), which is our `Qwen3MoeForCausalLM` with `norm_topk_prob`; the config's
`hidden_dim` is the experts' intermediate size. Its experts are stored stacked, [experts, ...] per
layer, as ours are (per-expert modules, as some checkpoints hold them, are stacked here too).
Tunix computes the router's logits in the model's compute dtype, ours in float32: in float32 the
two route alike; in bfloat16 a near tie between two experts' scores may route differently.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from seer_jax.errors import ConfigError
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params
from seer_jax.model.moe_config import MoeConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TunixFamily:
    """One Tunix model family: where its class lives and how it maps to our decoder."""

    name: str
    module: str  # the Tunix module defining the model class, ModelConfig and the attention
    class_name: str
    architecture: str  # our ModelConfig.architecture
    tied_field: str  # the Tunix config field that ties the output head to the embedding
    qkv_bias: bool = False
    qk_norm: bool = False
    max_len: int = 32768  # context length of the family's released checkpoints

    def mapping(self, pure: Mapping[str, Any]) -> Params:
        """Our nested param dict from the Tunix model's pure dict (layers stacked)."""
        return map_tunix_params(pure, self)


FAMILIES: tuple[TunixFamily, ...] = (
    TunixFamily("llama3", "tunix.models.llama3.model", "Llama3", "LlamaForCausalLM",
                "weight_tying", max_len=131072),
    TunixFamily("qwen2", "tunix.models.qwen2.model", "Qwen2", "Qwen2ForCausalLM",
                "use_tied_embedding", qkv_bias=True, max_len=32768),
    TunixFamily("qwen3", "tunix.models.qwen3.model", "Qwen3", "Qwen3ForCausalLM",
                "use_tied_embedding", qk_norm=True, max_len=40960),
)


def family_of(actor: Any) -> TunixFamily | None:
    """The Tunix family of `actor` (by class, including qwix's LoRA-wrapped subclasses), or None."""
    for cls in type(actor).__mro__:
        for fam in FAMILIES:
            if cls.__module__ == fam.module and cls.__name__ == fam.class_name:
                return fam
    return None


def applied_rope_theta(family: TunixFamily, tunix_config: Any) -> float:
    """The RoPE base the installed Tunix module really applies for this config.

    An attention block that calls the module's `apply_rope` without passing `rope_theta` rotates
    with the function's default; otherwise the config's value applies.
    """
    configured = float(tunix_config.rope_theta)
    module = sys.modules.get(family.module)
    attention = getattr(module, "Attention", None) if module is not None else None
    rope = getattr(module, "apply_rope", None) if module is not None else None
    if attention is None or rope is None:
        return configured
    try:
        source = inspect.getsource(attention.block)
    except (OSError, TypeError, AttributeError):
        return configured
    if "apply_rope(" not in source or "rope_theta" in source:
        return configured
    default = inspect.signature(rope).parameters.get("rope_theta")
    if default is None or default.default is inspect.Parameter.empty:
        return configured
    applied = float(default.default)
    if applied != configured:
        log.warning("%s: the Tunix model applies RoPE base %g, not its config's rope_theta=%g; "
                    "the rollout uses %g so it samples the policy the trainer computes",
                    family.name, applied, configured, applied)
    return applied


def model_config_from_tunix(actor: Any, family: TunixFamily | None = None,
                            max_len: int | None = None) -> ModelConfig:
    """Our ModelConfig for a Tunix Llama3 / Qwen2 / Qwen3 model (dtype: the model's compute
    dtype; max_position_embeddings: `max_len`, else the family's released context length)."""
    family = family or family_of(actor)
    if family is None:
        raise ConfigError(f"{type(actor).__name__} is not a Tunix model class seer_jax maps; "
                          f"supported: {[f.module + '.' + f.class_name for f in FAMILIES]}")
    tc = getattr(actor, "config", None)
    if tc is None:
        raise ConfigError(f"the {family.name} actor has no `config` attribute")
    moe = _moe_config(family, tc)
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM" if moe is not None else family.architecture,
        vocab_size=int(tc.vocab_size),
        hidden_size=int(tc.embed_dim),
        intermediate_size=int(tc.hidden_dim),
        num_layers=int(tc.num_layers),
        num_heads=int(tc.num_heads),
        num_kv_heads=int(tc.num_kv_heads),
        head_dim=int(tc.head_dim),
        rope_theta=applied_rope_theta(family, tc),
        rms_norm_eps=float(tc.norm_eps),
        tie_word_embeddings=bool(getattr(tc, family.tied_field, False)),
        qkv_bias=family.qkv_bias,
        qk_norm=family.qk_norm,
        max_position_embeddings=int(max_len or family.max_len),
        dtype=_compute_dtype(actor, tc),
        moe=moe,
    )


def _moe_config(family: TunixFamily, tc: Any) -> MoeConfig | None:
    """Our MoeConfig of a Tunix Qwen3 MoE config (None for a dense one)."""
    experts = getattr(tc, "num_experts", None)
    if not experts:
        return None
    if family.name != "qwen3":
        raise ConfigError(f"{family.name} config num_experts={experts}: only Tunix's Qwen3 "
                          "mixture of experts is mapped")
    k = getattr(tc, "num_experts_per_tok", None)
    if not k:
        raise ConfigError(f"qwen3 config num_experts={experts} with num_experts_per_tok={k!r}: "
                          "a mixture of experts needs both")
    # tunix's MoELayer: softmax top-k renormalised, no shared expert, every layer routed
    return MoeConfig(num_experts=int(experts), num_experts_per_tok=int(k),
                     expert_intermediate_size=int(tc.hidden_dim), norm_topk_prob=True)


def _compute_dtype(actor: Any, tc: Any) -> str:
    dtype = getattr(tc, "dtype", None)  # qwen2/qwen3: the compute dtype
    if dtype is None:  # llama3 computes in its parameters' dtype
        dtype = getattr(getattr(getattr(actor, "embedder", None), "input_embedding", None),
                        "dtype", jnp.float32)
    return "bfloat16" if jnp.dtype(dtype) == jnp.bfloat16 else "float32"


def map_tunix_params(pure: Mapping[str, Any], family: TunixFamily) -> Params:
    """Our nested param dict (layer weights stacked) from a Tunix model's pure dict."""
    try:
        layers = pure["layers"]
        num_layers = len(layers)
        per_layer = [layers[str(i)] if str(i) in layers else layers[i] for i in range(num_layers)]
        embed = pure["embedder"]["input_embedding"]
        d = embed.shape[1]

        def stack(*keys: str, shape: tuple[int, int] | None = None):
            def get(layer):
                for k in keys:
                    layer = layer[k]
                return layer if shape is None else layer.reshape(shape)
            return jnp.stack([get(layer) for layer in per_layer])

        ours: dict[str, Any] = {
            "attn_norm": stack("input_layernorm", "w"),
            "mlp_norm": stack("post_attention_layernorm", "w"),
            "wq": stack("attn", "q_proj", "w", shape=(d, -1)),
            "wk": stack("attn", "k_proj", "w", shape=(d, -1)),
            "wv": stack("attn", "v_proj", "w", shape=(d, -1)),
            "wo": stack("attn", "o_proj", "w", shape=(-1, d)),
        }
        if "router" in per_layer[0]["mlp"]:  # Qwen3 MoE: experts stacked [E, ...] per layer
            ours["router"] = stack("mlp", "router", "kernel")
            for ours_name, name in (("we_gate", "gate_proj"), ("we_up", "up_proj"),
                                    ("we_down", "down_proj")):
                ours[ours_name] = jnp.stack([_experts(layer["mlp"][name]) for layer in per_layer])
        else:
            ours["w_gate"] = stack("mlp", "gate_proj", "kernel")
            ours["w_up"] = stack("mlp", "up_proj", "kernel")
            ours["w_down"] = stack("mlp", "down_proj", "kernel")
        if family.qkv_bias:
            for x in "qkv":
                ours[f"b{x}"] = stack("attn", f"{x}_bias")
        if family.qk_norm:
            for x in "qk":
                ours[f"{x}_norm"] = stack("attn", f"{x}_norm", "w")
        params: Params = {"embed": embed, "final_norm": pure["final_norm"]["w"], "layers": ours}
        if "lm_head" in pure:
            params["lm_head"] = pure["lm_head"]["w"]
        return params
    except KeyError as e:
        raise ConfigError(f"the {family.name} state has no parameter {e.args[0]!r} where the "
                          f"Tunix {family.class_name} layout has one") from None


def _experts(x: Any):
    """One layer's expert weights [E, ...]: stacked already, or per expert ({"0": kernel, ...}
    or {"0": {"kernel": ...}}), stacked in expert order."""
    if not isinstance(x, Mapping):
        return x
    per = [x[str(e)] if str(e) in x else x[e] for e in range(len(x))]
    return jnp.stack([p["kernel"] if isinstance(p, Mapping) else p for p in per])
