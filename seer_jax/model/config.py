"""Static model configuration for the Llama family (Llama 2/3, Qwen2, Qwen3, SmolLM2), its
mixture-of-experts variants (Qwen3-MoE, Qwen2-MoE, Mixtral) and the DeepSeek-V3 family
(DeepSeek-V3/R1, Kimi-K2, Moonlight: multi-head latent attention and the DeepSeek MoE block)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.mla_config import MlaConfig, YarnScaling, mla_config_from_hf
from seer_jax.model.moe_config import (
    MoeConfig,
    deepseek_v2_moe_config,
    deepseek_v3_moe_config,
    moe_config_from_hf,
    refuse_unsupported_moe,
)

# How an engine holds the layer weights: "stacked" ([layers, ...] arrays, the layer loop a
# `lax.scan`), "per_layer" (a tuple of per-layer dicts, the loop unrolled; no array is sliced per
# layer), or "auto" (per_layer on GPUs, stacked elsewhere).
LAYER_WEIGHTS = ("auto", "stacked", "per_layer")

# architecture name -> (q/k/v bias, q/k RMSNorm)
ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# multi-head latent attention and the DeepSeek MoE block
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # multi-head latent attention (None: per-head K/V); its cache holds latent rows
    mla: MlaConfig | None = None
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    # mixture-of-experts MLPs (None: every layer dense); layers listed in moe.dense_layers keep a
    # dense MLP of intermediate_size
    moe: MoeConfig | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"architecture {self.architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model config {key}={value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.mla is not None:
            self.mla.validate()
            if self.num_kv_heads != self.num_heads:
                raise ConfigError(f"model config num_kv_heads={self.num_kv_heads}: latent "
                                  f"attention has one key/value per query head "
                                  f"(num_heads={self.num_heads})")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model config dtype={self.dtype!r}: allowed {DTYPES}")
        if self.rope_theta <= 0:
            raise ConfigError(f"model config rope_theta={self.rope_theta}: must be > 0")
        if self.moe is not None:
            self.moe.validate(self.num_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """"moe" or "dense" for each layer's MLP."""
        return tuple("moe" if self.is_moe_layer(i) else "dense" for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return sum(k == "moe" for k in self.layer_kinds)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_dtype(self, dtype: str) -> ModelConfig:
        return dataclasses.replace(self, dtype=dtype)

    def cost_spec(self, name: str = "served-model"):
        """This model as a `seer_jax.costs.ModelSpec` (GQA; routed experts counted apart from
        the parameters every token uses), for roofline step times."""
        from seer_jax.costs import ModelSpec

        itemsize = 4.0 if self.dtype == "float32" else 2.0
        n = float(self.num_params())
        routed = 0.0
        if self.moe is not None:
            m = self.moe
            routed = float(self.num_moe_layers * m.num_experts * 3 * self.hidden_size
                           * m.expert_intermediate_size)
        if self.mla is not None:  # absorbed attention: every head scores the latent rows
            head_dim = kv_elems = self.mla.cache_width
        else:
            head_dim, kv_elems = self.head_dim, 2 * self.num_kv_heads * self.head_dim
        experts = {}
        if self.moe is not None:
            experts = dict(num_experts=m.num_experts, experts_per_tok=m.num_experts_per_tok,
                           num_moe_layers=self.num_moe_layers,
                           params_per_expert=3.0 * self.hidden_size * m.expert_intermediate_size,
                           hidden_size=self.hidden_size,
                           expert_intermediate_size=m.expert_intermediate_size)
        return ModelSpec(name, n, float(self.num_params(active=True)), n - routed,
                         self.num_layers, self.num_heads, head_dim, kv_elems,
                         itemsize, itemsize, **experts)

    def kv_bytes_per_token(self) -> int:
        """Cached bytes per token over all layers: K and V, or MLA's latent rows."""
        itemsize = 4 if self.dtype == "float32" else 2
        if self.mla is not None:
            return self.mla.cache_bytes_per_token(self.num_layers, itemsize)
        return 2 * self.num_layers * self.kv_size * itemsize

    def num_params(self, active: bool = False) -> int:
        """All parameters, or (`active`) those one token uses (its routed experts only)."""
        d, f, L = self.hidden_size, self.intermediate_size, self.num_layers
        if self.mla is not None:
            m, H = self.mla, self.num_heads
            q = (d * H * m.qk_head_dim if m.q_lora_rank is None
                 else m.q_lora_rank * (d + 1 + H * m.qk_head_dim))
            per_layer = (q + d * m.cache_width + m.kv_lora_rank * (1 + H * (m.qk_nope_head_dim
                         + m.v_head_dim)) + H * m.v_head_dim * d + 2 * d)
        else:
            per_layer = d * (self.q_size + 2 * self.kv_size) + self.q_size * d + 2 * d
        num_moe = self.num_moe_layers
        mlp = (L - num_moe) * 3 * d * f
        if self.moe is not None:
            mlp += num_moe * self.moe.num_params(d, active)
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + L * per_layer + mlp + d + head

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Build from a HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(hf.get("model_type", ""), None)
        if arch is None:
            raise ConfigError(
                f"config.json names no architecture (architectures={archs!r}, "
                f"model_type={hf.get('model_type')!r}); supported: {sorted(ARCHITECTURES)}"
            )
        refuse_unsupported_moe(arch, hf)
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"config.json architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ConfigError(f"config.json hidden_act={hf.get('hidden_act')!r}: only silu is supported")
        qkv_bias, qk_norm = ARCHITECTURES[arch]
        if arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and hf.get("attention_bias"):
            qkv_bias = True
        if hf.get("mlp_bias"):
            raise ConfigError("config.json mlp_bias=True is not supported")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling_src = rope if rope.get("rope_type", "default") != "default" else legacy
        rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default")) if scaling_src else "default"
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(scaling_src["factor"]),
                low_freq_factor=float(scaling_src["low_freq_factor"]),
                high_freq_factor=float(scaling_src["high_freq_factor"]),
                original_max_position_embeddings=int(scaling_src["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None) and arch not in MLA_ARCHITECTURES:
            raise ConfigError(f"config.json rope type {rope_type!r}: only 'default' and 'llama3' are supported")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        mla = moe = None
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        if arch in MLA_ARCHITECTURES:
            if arch == "DeepseekV2ForCausalLM":
                # V2's router is softmax top-k; it rotates interleaved pairs (as complex numbers)
                moe = deepseek_v2_moe_config(hf)
                mla = dataclasses.replace(mla_config_from_hf(hf), rope_interleave=True)
            else:
                moe = deepseek_v3_moe_config(hf)
                mla = mla_config_from_hf(hf)
            # one latent per token serves every head; head_dim is a head's query/key width
            head_dim, num_kv_heads = mla.qk_head_dim, num_heads
        elif arch in MOE_ARCHITECTURES:
            moe = moe_config_from_hf(arch, hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=dtype,
            mla=mla,
            moe=moe,
        )

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path, dtype: str = "float32") -> ModelConfig:
        cfg_path = pathlib.Path(path) / "config.json"
        if not cfg_path.is_file():
            raise SeerError(f"no config.json in {path}")
        try:
            hf = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise SeerError(f"{cfg_path} is not valid JSON: {e}") from e
        return cls.from_hf_dict(hf, dtype=dtype)


def tiny_config(**overrides: Any) -> ModelConfig:
    """A small random-init config for unit tests."""
    base = dict(
        architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-5, max_position_embeddings=1024, eos_token_ids=(2,),
    )
    base.update(overrides)
    return ModelConfig(**base)


def tiny_deepseek_config(**overrides: Any) -> ModelConfig:
    """A small DeepSeek-V3-shaped config for unit tests: latent attention with a query LoRA and
    YaRN, a dense first layer, then sigmoid group-limited routing over 8 experts with a shared
    expert."""
    base: dict[str, Any] = dict(
        architecture="DeepseekV3ForCausalLM", num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=24,
        mla=MlaConfig(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                      q_lora_rank=24, yarn=YarnScaling(4.0, 128, mscale=1.0, mscale_all_dim=1.0)),
        moe=MoeConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32,
                      scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
                      score_correction_bias=True, n_group=2, topk_group=1,
                      shared_intermediate_size=32, dense_layers=(0,)))
    base.update(overrides)
    return tiny_config(**base)
