"""Read a GGUF file into a HF-style config dict and float32 tensors with HF names and layouts.

GGUF (llama.cpp's format) stores Llama weights under its own names (`blk.0.attn_q.weight`), often
quantized, and with the rows of Q and K permuted: llama.cpp's converter reorders each head's rows
from HF's "rotate half" RoPE layout to interleaved pairs. We dequantize with the `gguf` package and
undo that permutation, so the result equals the HF checkpoint and the model code needs one layout.
Qwen2/Qwen3 GGUFs are not permuted (llama.cpp runs them with NeoX-style RoPE) and pass through.

    config, tensors = load_gguf("model.gguf")   # config uses HF config.json keys
    tok = read_gguf_tokenizer("model.gguf")     # vocab, merges, special ids, chat template
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re

import numpy as np

from seer_jax.errors import SeerError

GGUF_MAGIC = b"GGUF"

# GGUF architecture -> (HF architecture, HF model_type, whether llama.cpp permuted Q/K rows).
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

# Per-layer GGUF tensor names (after `blk.N.`) -> HF names (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerData:
    """The tokenizer a GGUF describes, under friendlier names than llama.cpp's metadata keys."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (sentencepiece), ...
    pre: str | None  # tokenizer.ggml.pre: the pre-tokenizer flavour, e.g. "smollm", "llama-bpe"
    tokens: list[str]
    token_types: list[int]  # llama.cpp token types: 1 normal, 3 control, 4 user-defined, ...
    merges: list[str]  # "a b" strings, best first
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` for `path`, or a SeerError saying why the file is not a usable GGUF."""
    import gguf

    path = pathlib.Path(path)
    if not path.exists():
        raise SeerError(f"GGUF file not found: {path}")
    if not path.is_file():
        raise SeerError(f"not a GGUF file (not a regular file): {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise SeerError(f"not a GGUF file (bad magic {magic!r}, expected {GGUF_MAGIC!r}): {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated or corrupt file: one clear message, not a parser traceback
        raise SeerError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from e


def read_gguf_metadata(reader) -> dict:
    """Scalar and small-array metadata of an open GGUF (large string arrays left out)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            continue
        if key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        out[key] = field.contents()
    return out


def gguf_architecture(reader) -> str:
    field = reader.get_field("general.architecture")
    if field is None:
        raise SeerError("GGUF file has no general.architecture")
    return field.contents()


def gguf_hf_config(reader) -> dict:
    """The HF `config.json` equivalent of a GGUF's metadata (Llama, Qwen2, Qwen3)."""
    arch = gguf_architecture(reader)
    if arch not in ARCHITECTURES:
        raise SeerError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    hf_arch, model_type, _ = ARCHITECTURES[arch]
    meta = read_gguf_metadata(reader)

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise SeerError(f"GGUF file is missing metadata key {full!r}")
        return default

    if get("expert_count", 0, required=False):
        raise SeerError(f"mixture-of-experts GGUF ({arch}, {get('expert_count')} experts) is not supported")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise SeerError(f"partial rotary embeddings (rope dim {rope_dim} of head dim {head_dim}) not supported")
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size", None, required=False)
    if vocab is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is not None:
            vocab = len(tokens.data)
        else:
            embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
            vocab = int(embd.shape[-1])

    config = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": _f32_to_float(get("rope.freq_base", 10000.0)),
        "rms_norm_eps": _f32_to_float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    if model_type in ("qwen2", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    rope_scaling = _rope_scaling(reader, arch, meta, head_dim, config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def load_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """`(hf_config_dict, tensors)`: HF config.json keys, and float32 arrays with HF names/layouts.

    Linear weights are `[out, in]` like HF's; Llama Q/K rows are un-permuted back to HF's order.
    `lm_head.weight` is present only when the embeddings are not tied. `path` may also be a reader
    from `open_gguf` (parsing the file's header takes ~1.6 s for SmolLM2; share it).
    """
    import gguf

    reader = path if hasattr(path, "tensors") else open_gguf(path)
    config = gguf_hf_config(reader)
    _, _, permuted = ARCHITECTURES[gguf_architecture(reader)]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # folded into config["rope_scaling"] above
            continue
        hf_name = _hf_tensor_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise SeerError(f"GGUF tensor {t.name}: quantization {t.tensor_type.name} not supported") from e
        w = np.array(w, dtype=np.float32).reshape(shape)  # copy: detached from the file mapping
        if permuted and t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, heads)
        elif permuted and t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, kv_heads)
        tensors[hf_name] = w
    _check_shapes(config, tensors)
    return config, tensors


def unpermute_qk(w_oi: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: per head, rows `[2, d/2]` were stored as `[d/2, 2]`.

    llama.cpp's converter does `w.reshape(n, 2, d/2, *rest).swapaxes(1, 2)`; this is its inverse.
    """
    out_dim = w_oi.shape[0]
    if out_dim % (2 * n_heads):
        raise SeerError(f"cannot un-permute a Q/K weight with {out_dim} rows over {n_heads} heads")
    half = out_dim // n_heads // 2
    return w_oi.reshape(n_heads, half, 2, *w_oi.shape[1:]).swapaxes(1, 2).reshape(w_oi.shape)


def permute_qk(w_oi: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF layout -> GGUF layout); the inverse of `unpermute_qk`."""
    half = w_oi.shape[0] // n_heads // 2
    return w_oi.reshape(n_heads, 2, half, *w_oi.shape[1:]).swapaxes(1, 2).reshape(w_oi.shape)


def read_gguf_tokenizer(path_or_reader) -> GGUFTokenizerData:
    """The tokenizer metadata of a GGUF: vocab, merges, token types, special ids, chat template."""
    reader = path_or_reader if hasattr(path_or_reader, "fields") else open_gguf(path_or_reader)
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise SeerError("GGUF file carries no tokenizer (no tokenizer.ggml.model)")
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    types = _field(reader, "tokenizer.ggml.token_type")
    return GGUFTokenizerData(
        model=model,
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=_strings(reader, "tokenizer.ggml.tokens"),
        token_types=list(types) if types is not None else [1] * n_tokens,
        merges=_strings(reader, "tokenizer.ggml.merges"),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        unk_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _f32_to_float(x) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. Give the short decimal."""
    return float(str(np.float32(x)))


def _field(reader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _strings(reader, key: str) -> list[str]:
    field = reader.get_field(key)
    if field is None:
        return []
    parts = field.parts
    return [parts[i].tobytes().decode("utf-8") for i in field.data]


def _hf_tensor_name(name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    raise SeerError(f"GGUF tensor {name!r} has no HF equivalent known to seer_jax")


def _check_shapes(config: dict, tensors: dict[str, np.ndarray]) -> None:
    d, hd = config["hidden_size"], config["head_dim"]
    expect = {
        "model.embed_tokens.weight": (config["vocab_size"], d),
        "model.layers.0.self_attn.q_proj.weight": (config["num_attention_heads"] * hd, d),
        "model.layers.0.self_attn.k_proj.weight": (config["num_key_value_heads"] * hd, d),
        "model.layers.0.mlp.up_proj.weight": (config["intermediate_size"], d),
    }
    for name, shape in expect.items():
        got = tensors.get(name)
        if got is None:
            raise SeerError(f"GGUF file has no tensor for {name}")
        if got.shape != shape:
            raise SeerError(f"GGUF tensor {name} has shape {got.shape}, metadata implies {shape}")
    n = sum(1 for k in tensors if k.endswith("input_layernorm.weight"))
    if n != config["num_hidden_layers"]:
        raise SeerError(f"GGUF file has {n} layers of tensors, metadata says {config['num_hidden_layers']}")


def _rope_scaling(reader, arch: str, meta: dict, head_dim: int, theta: float) -> dict | None:
    """HF `rope_scaling` from GGUF metadata, or from a Llama-3 `rope_freqs` tensor."""
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return _llama3_scaling_from_freqs(np.asarray(freqs.data, np.float32).ravel(), head_dim, theta)
    if rope_type in (None, "none") or not factor:
        return None
    out = {"rope_type": str(rope_type), "factor": float(factor)}
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    return out


def _llama3_scaling_from_freqs(rope_freqs: np.ndarray, head_dim: int, theta: float) -> dict:
    """Recover Llama-3 `rope_scaling` from the per-frequency divisors llama.cpp stores.

    GGUF keeps only the divisors, not the parameters that made them. Every released Llama 3.x uses
    low/high frequency factors 1 and 4 over an 8192-token original context, with `factor` the
    largest divisor; we rebuild the divisors from those and accept them only if they match.
    """
    factor = float(rope_freqs.max())
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = llama3_rope_divisors(params, head_dim, theta)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-5, atol=1e-6):
        raise SeerError(
            "GGUF rope_freqs tensor does not match Llama-3 rope scaling with the usual parameters "
            "(low 1, high 4, original context 8192); load the HF checkpoint instead"
        )
    return params


def llama3_rope_divisors(params: dict, head_dim: int, theta: float) -> np.ndarray:
    """Per-frequency divisors of Llama-3 rope scaling (what llama.cpp writes as `rope_freqs`)."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_ctx = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)
