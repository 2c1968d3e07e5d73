"""Weight loading: HF safetensors directories, GGUF files, Orbax checkpoints.

All loaders end in `hf_tensors_to_params`, which maps HF tensor names/layouts onto our stacked
parameter dict and checks every shape against the config.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from seer_jax.errors import SeerError
from seer_jax.model.config import ModelConfig, RopeScaling
from seer_jax.model.llama import Params, jnp_dtype, key_kind, nest_params, param_shapes
from seer_jax.model.mla_config import MlaConfig, YarnScaling
from seer_jax.model.moe_config import MoeConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# HF per-layer tensor name -> (our name, transpose)
_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    # multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight; q_proj and o_proj above)
    "self_attn.q_a_proj.weight": ("wq_a", True),
    "self_attn.q_a_layernorm.weight": ("q_a_norm", False),
    "self_attn.q_b_proj.weight": ("wq_b", True),
    "self_attn.kv_a_proj_with_mqa.weight": ("wkv_a", True),
    "self_attn.kv_a_layernorm.weight": ("kv_a_norm", False),
    "self_attn.kv_b_proj.weight": ("wkv_b", True),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    # mixture of experts (Qwen2/3-MoE, DeepSeek-V3 "mlp.", Mixtral "block_sparse_moe.")
    "mlp.gate.weight": ("router", True),
    "block_sparse_moe.gate.weight": ("router", True),
    "mlp.gate.e_score_correction_bias": ("router_bias", False),
    "mlp.shared_expert.gate_proj.weight": ("ws_gate", True),
    "mlp.shared_expert.up_proj.weight": ("ws_up", True),
    "mlp.shared_expert.down_proj.weight": ("ws_down", True),
    "mlp.shared_expert_gate.weight": ("ws_router", True),
    "mlp.shared_experts.gate_proj.weight": ("ws_gate", True),
    "mlp.shared_experts.up_proj.weight": ("ws_up", True),
    "mlp.shared_experts.down_proj.weight": ("ws_down", True),
}
# per-expert HF tensor (after "<prefix>.experts.<j>.") -> our stacked expert tensor
_EXPERT_MAP = {
    "gate_proj.weight": "we_gate", "up_proj.weight": "we_up", "down_proj.weight": "we_down",
    "w1.weight": "we_gate", "w3.weight": "we_up", "w2.weight": "we_down",
}
_EXPERT_PREFIXES = ("mlp.experts.", "block_sparse_moe.experts.")


def _layer_tensor(sub: str, arr: np.ndarray, per_expert: dict, per_layer_item) -> bool:
    """File one tensor of a layer (its name `sub` after "model.layers.<i>."); False if unknown."""
    if sub in _LAYER_MAP:
        ours, transpose = _LAYER_MAP[sub]
        per_layer_item(ours, np.asarray(arr).T if transpose else arr)
        return True
    if sub in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # fused [E, out, in]
        a = np.swapaxes(np.asarray(arr), 1, 2)
        if sub.endswith("down_proj"):
            per_layer_item("we_down", a)
        else:
            f = a.shape[2] // 2
            per_layer_item("we_gate", a[:, :, :f])
            per_layer_item("we_up", a[:, :, f:])
        return True
    for prefix in _EXPERT_PREFIXES:
        if sub.startswith(prefix):
            j, _, rest = sub[len(prefix):].partition(".")
            if j.isdigit() and rest in _EXPERT_MAP:
                per_expert.setdefault(_EXPERT_MAP[rest], {})[int(j)] = np.asarray(arr).T
                return True
    return False


def moe_layer_from_hf(moe: MoeConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One MoE layer's params from its HF tensors (named as after "model.layers.<i>.": "mlp.gate.weight",
    "mlp.experts.3.up_proj.weight" or the fused "mlp.experts.gate_up_proj", ...)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for sub, arr in tensors.items():
        if not _layer_tensor(sub, arr, experts, out.__setitem__):
            raise SeerError(f"MoE layer tensor {sub!r} is not one this block uses")
    for ours, by_index in experts.items():
        out[ours] = np.stack([by_index[j] for j in range(moe.num_experts)])
    return out


def hf_tensors_to_params(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> Params:
    """Map HF-named tensors ([out, in] linear layout) to our params; check shapes and coverage.
    Per-expert tensors are stacked on an experts axis, then each layer key over the layers that
    hold it (every layer, the MoE layers, or the dense-MLP layers)."""
    expected = param_shapes(cfg)
    L = cfg.num_layers
    flat: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
    per_expert: list[dict[str, dict[int, np.ndarray]]] = [{} for _ in range(L)]
    unused = []
    for name, arr in tensors.items():
        if name == "model.embed_tokens.weight":
            flat["embed"] = arr
        elif name == "model.norm.weight":
            flat["final_norm"] = arr
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                flat["lm_head"] = np.asarray(arr).T
        elif name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, sub = rest.partition(".")
            if not idx.isdigit():
                unused.append(name)
                continue
            i = int(idx)
            if i >= L and cfg.mla is not None:
                continue  # DeepSeek-V3's multi-token-prediction layers: not used to generate
            if i >= L:
                raise SeerError(f"checkpoint has tensor {name} but config has num_hidden_layers={L}")

            def item(ours, a, i=i):
                per_layer.setdefault(ours, [None] * L)[i] = a

            if not _layer_tensor(sub, arr, per_expert[i], item):
                unused.append(name)
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            unused.append(name)
    for i, experts in enumerate(per_expert):
        for ours, by_index in experts.items():
            E = cfg.moe.num_experts if cfg.moe is not None else 0
            if sorted(by_index) != list(range(E)):
                missing = sorted(set(range(E)) - set(by_index))
                raise SeerError(f"layer {i} tensor {ours!r}: checkpoint holds experts "
                                f"{sorted(by_index)[:8]}..., config num_experts={E} "
                                f"(missing {missing[:5]})")
            per_layer.setdefault(ours, [None] * L)[i] = np.stack([by_index[j] for j in range(E)])
    kinds = cfg.layer_kinds
    for ours, items in per_layer.items():
        kind = key_kind(ours)
        want = [i for i in range(L) if kind in (None, kinds[i])]
        have = [i for i, a in enumerate(items) if a is not None]
        if have != want:
            missing = sorted(set(want) - set(have))
            if missing:
                raise SeerError(f"checkpoint is missing layer(s) {missing[:5]} of tensor {ours!r}")
            raise SeerError(f"checkpoint has tensor {ours!r} in layer(s) "
                            f"{sorted(set(have) - set(want))[:5]}, which the config makes "
                            f"{'MoE' if kind == 'dense' else 'dense'} layers")
        shapes = {items[i].shape for i in have}
        if len(shapes) != 1:
            raise SeerError(f"tensor {ours!r} has different shapes across layers: {sorted(shapes)}")
        flat[f"layers/{ours}"] = np.stack([items[i] for i in have])
    for key, shape in expected.items():
        if key not in flat:
            raise SeerError(f"checkpoint has no weights for {key!r} (expected shape {shape})")
        if tuple(flat[key].shape) != shape:
            raise SeerError(
                f"shape mismatch between config and weights for {key!r}: config implies {shape}, "
                f"checkpoint has {tuple(flat[key].shape)}"
            )
    extra = sorted(set(flat) - set(expected))
    if extra or unused:
        raise SeerError(f"checkpoint has tensors this architecture does not use: {(extra + unused)[:8]}")
    dtype = jnp_dtype(cfg)
    return nest_params({k: jnp.asarray(np.asarray(v, np.float32), dtype) for k, v in flat.items()})


def _refuse_pickle(path: pathlib.Path) -> None:
    raise SeerError(
        f"{path} is a pickle checkpoint ({path.suffix}); seer_jax refuses to load pickles (they can "
        "run arbitrary code). Convert it to safetensors, e.g. with transformers: "
        "model.save_pretrained(dir, safe_serialization=True)."
    )


def load_safetensors_dir(path: str | pathlib.Path, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Load a HF checkpoint directory: config.json + model.safetensors or a sharded index.
    Tensors of any stored dtype (bfloat16, float8 included); FP8 weights with block scales
    (DeepSeek-V3's `quantization_config`) are dequantized on load."""
    from seer_jax.model.safetensors_io import (
        dequantize_checkpoint,
        fp8_block_size,
        read_safetensors,
    )

    path = pathlib.Path(path)
    cfg = ModelConfig.from_hf_dir(path, dtype=dtype)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            _refuse_pickle(pickles[0])
        raise SeerError(f"no *.safetensors files in {path}")
    stored: dict[str, np.ndarray] = {}
    for f in files:
        if not f.is_file():
            raise SeerError(f"safetensors shard {f} listed in the index is missing")
        stored.update(read_safetensors(f))
    block = fp8_block_size(json.loads((path / "config.json").read_text()))
    tensors = {k: v if v.dtype == np.float32 else v.astype(np.float32)
               for k, v in dequantize_checkpoint(stored, block).items()}
    return cfg, hf_tensors_to_params(cfg, tensors)


def load_gguf_model(path: str | pathlib.Path, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    from seer_jax.model.gguf import load_gguf

    hf_config, tensors = load_gguf(path)
    cfg = ModelConfig.from_hf_dict(hf_config, dtype=dtype)
    return cfg, hf_tensors_to_params(cfg, tensors)


# ---------------------------------------------------------------------------- Orbax

ORBAX_CONFIG = "seer_config.json"


def save_orbax(path: str | pathlib.Path, cfg: ModelConfig, params: Params) -> pathlib.Path:
    """Save params + config as an Orbax checkpoint directory (overwrites)."""
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", params, force=True)
    (path / ORBAX_CONFIG).write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    return path


def load_orbax(path: str | pathlib.Path, dtype: str | None = None) -> tuple[ModelConfig, Params]:
    import orbax.checkpoint as ocp

    path = pathlib.Path(path).absolute()
    meta = json.loads((path / ORBAX_CONFIG).read_text())
    if meta.get("rope_scaling"):
        meta["rope_scaling"] = RopeScaling(**meta["rope_scaling"])
    meta["eos_token_ids"] = tuple(meta.get("eos_token_ids") or ())
    if meta.get("moe"):
        meta["moe"] = MoeConfig(**{**meta["moe"], "dense_layers": tuple(meta["moe"]["dense_layers"])})
    if meta.get("mla"):
        yarn = meta["mla"].get("yarn")
        meta["mla"] = MlaConfig(**{**meta["mla"], "yarn": YarnScaling(**yarn) if yarn else None})
    cfg = ModelConfig(**meta)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(path / "params")
    params = _to_plain(params)
    if dtype is not None and dtype != cfg.dtype:
        cfg = cfg.with_dtype(dtype)
        params = _cast(params, jnp_dtype(cfg))
    return cfg, params


def _to_plain(tree):
    if isinstance(tree, dict):
        return {k: _to_plain(v) for k, v in tree.items()}
    return jnp.asarray(tree)


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    return tree.astype(dtype)


# ---------------------------------------------------------------------------- dispatch


def load_model(name_or_path: str | pathlib.Path, dtype: str = "float32") -> tuple[ModelConfig, Params]:
    """Load a model from "smollm2" (fetched GGUF), a .gguf file, a HF safetensors directory or an
    Orbax checkpoint directory written by `save_orbax`."""
    from seer_jax.model.hub import resolve_model

    path = resolve_model(str(name_or_path))
    if path.is_file():
        if path.suffix == ".gguf":
            return load_gguf_model(path, dtype)
        if path.suffix in PICKLE_SUFFIXES:
            _refuse_pickle(path)
        if path.suffix == ".safetensors":
            return load_safetensors_dir(path.parent, dtype)
        raise SeerError(f"don't know how to load {path}: expected a .gguf file or a checkpoint directory")
    if (path / ORBAX_CONFIG).is_file():
        return load_orbax(path, dtype)
    if (path / "config.json").is_file():
        return load_safetensors_dir(path, dtype)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf_model(ggufs[0], dtype)
    raise SeerError(
        f"{path} is not a model directory: expected config.json + *.safetensors, an Orbax checkpoint "
        f"({ORBAX_CONFIG}), or a single .gguf file"
    )
