"""Write a tiny random Hugging Face checkpoint (config.json, safetensors, a byte tokenizer).

    python -m seer_jax.model.tiny_checkpoint OUT_DIR [--arch Qwen3MoeForCausalLM] [--shards 2]

The weights are our random init (`init_params`) written under the HF tensor names of the
architecture (per-expert tensors, as HF checkpoints hold them), sharded with an index when
`--shards` > 1; the tokenizer is byte-level (256 byte tokens and `<|endoftext|>`, a plain chat
template), so
`seer-jax generate --model OUT_DIR --prompt ...` runs end to end without a model hub. No
transformers needed; transformers loads the result too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import numpy as np

from seer_jax.errors import ConfigError
from seer_jax.model.config import ARCHITECTURES, ModelConfig, tiny_deepseek_config
from seer_jax.model.llama import Params, flat_params, init_params, key_kind
from seer_jax.model.moe_config import MoeConfig

_MODEL_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
               "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
               "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}
EOS = "<|endoftext|>"
# a plain chat template, so chat prompts (`--chat`, rollout prompt sets) work
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def tiny_model_config(arch: str = "Qwen3MoeForCausalLM") -> ModelConfig:
    """2 layers, hidden 64; MoE architectures: 8 experts, top 2 (DeepSeek-V3: 3 layers, the
    first dense, latent attention with YaRN)."""
    if arch not in _MODEL_TYPE:
        raise ConfigError(f"--arch {arch!r}: choose one of {sorted(_MODEL_TYPE)}")
    if arch == "DeepseekV3ForCausalLM":
        return tiny_deepseek_config(vocab_size=288, rms_norm_eps=1e-6, eos_token_ids=(256,),
                                    max_position_embeddings=512)
    qkv_bias, qk_norm = ARCHITECTURES[arch]
    moe = None
    if arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        mixtral = arch == "MixtralForCausalLM"
        moe = MoeConfig(num_experts=8, num_experts_per_tok=2,
                        expert_intermediate_size=96 if mixtral else 32,
                        norm_topk_prob=arch != "Qwen2MoeForCausalLM",
                        shared_intermediate_size=48 if arch == "Qwen2MoeForCausalLM" else 0,
                        shared_gate=arch == "Qwen2MoeForCausalLM")
    return ModelConfig(architecture=arch, vocab_size=288, hidden_size=64, intermediate_size=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6,
                       rms_norm_eps=1e-6, qkv_bias=qkv_bias, qk_norm=qk_norm,
                       max_position_embeddings=2048, eos_token_ids=(256,), moe=moe)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """`config.json` for cfg (what `ModelConfig.from_hf_dict` reads back)."""
    if cfg.rope_scaling is not None:
        raise ConfigError("hf_config_dict writes default RoPE only")
    hf: dict[str, Any] = {
        "architectures": [cfg.architecture], "model_type": _MODEL_TYPE[cfg.architecture],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": cfg.dtype,
        "attention_bias": cfg.qkv_bias,
    }
    if cfg.mla is not None:
        _deepseek_v3_fields(cfg, hf)
        return hf
    m = cfg.moe
    if m is not None:
        if m.scoring != "softmax" or m.routed_scaling_factor != 1.0 or m.n_group != 1:
            raise ConfigError("hf_config_dict writes softmax-routed MoE configs only")
        hf.update(num_experts_per_tok=m.num_experts_per_tok)
        if cfg.architecture == "MixtralForCausalLM":
            hf.update(num_local_experts=m.num_experts, intermediate_size=m.expert_intermediate_size,
                      sliding_window=None)
        else:
            hf.update(num_experts=m.num_experts, moe_intermediate_size=m.expert_intermediate_size,
                      norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
                      mlp_only_layers=list(m.dense_layers), use_sliding_window=False)
            if cfg.architecture == "Qwen2MoeForCausalLM":
                hf.update(shared_expert_intermediate_size=m.shared_intermediate_size)
    return hf


def _deepseek_v3_fields(cfg: ModelConfig, hf: dict[str, Any]) -> None:
    a, m = cfg.mla, cfg.moe
    if m is None or m.scoring != "sigmoid" or list(m.dense_layers) != list(range(len(m.dense_layers))):
        raise ConfigError("hf_config_dict writes DeepSeek-V3 configs with sigmoid routing and "
                          "the dense layers first")
    del hf["head_dim"]
    hf.update(kv_lora_rank=a.kv_lora_rank, q_lora_rank=a.q_lora_rank,
              qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
              v_head_dim=a.v_head_dim, rope_interleave=a.rope_interleave,
              n_routed_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
              moe_intermediate_size=m.expert_intermediate_size,
              n_shared_experts=m.shared_intermediate_size // m.expert_intermediate_size,
              n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.norm_topk_prob,
              routed_scaling_factor=m.routed_scaling_factor, topk_method="noaux_tc",
              scoring_func="sigmoid", first_k_dense_replace=len(m.dense_layers))
    if a.yarn is not None:
        y = a.yarn
        hf["rope_scaling"] = {"type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast,
                              "beta_slow": y.beta_slow, "mscale": y.mscale,
                              "mscale_all_dim": y.mscale_all_dim,
                              "original_max_position_embeddings": y.original_max_position_embeddings}


# our layer key -> HF name after "model.layers.<i>." ({e}: expert index), transposed on write
_HF_NAMES = {
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "router": "mlp.gate.weight", "router_bias": "mlp.gate.e_score_correction_bias",
    "we_gate": "mlp.experts.{e}.gate_proj.weight", "we_up": "mlp.experts.{e}.up_proj.weight",
    "we_down": "mlp.experts.{e}.down_proj.weight",
    "ws_gate": "mlp.shared_expert.gate_proj.weight", "ws_up": "mlp.shared_expert.up_proj.weight",
    "ws_down": "mlp.shared_expert.down_proj.weight", "ws_router": "mlp.shared_expert_gate.weight",
}
_DEEPSEEK_NAMES = {
    "wq_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
    "wq_b": "self_attn.q_b_proj.weight", "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight", "wkv_b": "self_attn.kv_b_proj.weight",
    "ws_gate": "mlp.shared_experts.gate_proj.weight", "ws_up": "mlp.shared_experts.up_proj.weight",
    "ws_down": "mlp.shared_experts.down_proj.weight"}
_MIXTRAL_NAMES = {"router": "block_sparse_moe.gate.weight",
                  "we_gate": "block_sparse_moe.experts.{e}.w1.weight",
                  "we_up": "block_sparse_moe.experts.{e}.w3.weight",
                  "we_down": "block_sparse_moe.experts.{e}.w2.weight"}


def params_to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Our (stacked) params under HF tensor names, [out, in] linear layout, experts one by one."""
    extra = {"MixtralForCausalLM": _MIXTRAL_NAMES, "DeepseekV3ForCausalLM": _DEEPSEEK_NAMES}
    names = {**_HF_NAMES, **extra.get(cfg.architecture, {})}
    flat = {k: np.asarray(v, np.float32) for k, v in flat_params(params).items()}
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = np.ascontiguousarray(flat["lm_head"].T)
    kinds = cfg.layer_kinds
    for key, stacked in flat.items():
        if not key.startswith("layers/"):
            continue
        ours = key.split("/", 1)[1]
        holders = [i for i in range(cfg.num_layers) if key_kind(ours) in (None, kinds[i])]
        for j, layer in enumerate(holders):
            a = stacked[j]
            if ours.startswith("we_"):
                for e in range(a.shape[0]):
                    out[f"model.layers.{layer}.{names[ours].format(e=e)}"] = np.ascontiguousarray(a[e].T)
            else:
                out[f"model.layers.{layer}.{names[ours]}"] = np.ascontiguousarray(a.T if a.ndim == 2 else a)
    return out


def byte_tokenizer_json() -> dict[str, Any]:
    """A byte-level BPE `tokenizer.json` with no merges: ids 0-255 the bytes, 256 `EOS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return json.loads(tok.to_str())


def _byte_of(char: str) -> int:
    """The byte a GPT-2 byte-level alphabet character stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    code = ord(char)
    return code if code in printable else rest[code - 256]


def write_tiny_checkpoint(out_dir: str | pathlib.Path, arch: str = "Qwen3MoeForCausalLM",
                          seed: int = 0, shards: int = 1) -> pathlib.Path:
    from safetensors.numpy import save_file

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_model_config(arch)
    tensors = params_to_hf_tensors(cfg, init_params(cfg, seed))
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=1))
    names = sorted(tensors)
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({n: tensors[n] for n in part}, str(out / file))
            weight_map.update(dict.fromkeys(part, file))
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(int(t.nbytes) for t in tensors.values())},
             "weight_map": weight_map}, indent=1))
    (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "add_bos_token": False, "chat_template": CHAT_TEMPLATE}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", default="Qwen3MoeForCausalLM", help=", ".join(sorted(_MODEL_TYPE)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=1, help="safetensors files (an index when > 1)")
    args = p.parse_args(argv)
    print(write_tiny_checkpoint(args.out_dir, args.arch, args.seed, args.shards))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
