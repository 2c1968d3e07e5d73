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
from seer_jax.model.llama import Params, jnp_dtype, nest_params, param_shapes

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
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}


def hf_tensors_to_params(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> Params:
    """Map HF-named tensors ([out, in] linear layout) to our params; check shapes and coverage."""
    expected = param_shapes(cfg)
    L = cfg.num_layers
    flat: dict[str, Any] = {}
    per_layer: dict[str, list] = {}
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
            if sub not in _LAYER_MAP or not idx.isdigit():
                unused.append(name)
                continue
            ours, transpose = _LAYER_MAP[sub]
            i = int(idx)
            if i >= L:
                raise SeerError(f"checkpoint has tensor {name} but config has num_hidden_layers={L}")
            per_layer.setdefault(ours, [None] * L)[i] = np.asarray(arr).T if transpose else arr
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        else:
            unused.append(name)
    for ours, items in per_layer.items():
        missing = [i for i, a in enumerate(items) if a is None]
        if missing:
            raise SeerError(f"checkpoint is missing layer(s) {missing[:5]} of tensor {ours!r}")
        shapes = {a.shape for a in items}
        if len(shapes) != 1:
            raise SeerError(f"tensor {ours!r} has different shapes across layers: {sorted(shapes)}")
        flat[f"layers/{ours}"] = np.stack(items)
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
