"""GGUF loading: HF names, HF layouts (Q/K un-permuted), config from metadata, clear errors."""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest

from seer_jax.errors import SeerError
from seer_jax.model import hub
from seer_jax.model.gguf import (
    gguf_hf_config,
    llama3_rope_divisors,
    load_gguf,
    open_gguf,
    permute_qk,
    read_gguf_tokenizer,
    unpermute_qk,
)

TINY = dict(vocab=96, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=48, layers=2)


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, written out independently."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def tiny_hf_tensors(rng: np.random.Generator, tied: bool = True, bias: bool = False, qk_norm: bool = False):
    c = TINY
    d, hd = c["hidden"], c["head_dim"]
    t = {
        "model.embed_tokens.weight": rng.standard_normal((c["vocab"], d)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(d),
    }
    if not tied:
        t["lm_head.weight"] = rng.standard_normal((c["vocab"], d))
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        t[p + "self_attn.q_proj.weight"] = rng.standard_normal((c["heads"] * hd, d))
        t[p + "self_attn.k_proj.weight"] = rng.standard_normal((c["kv_heads"] * hd, d))
        t[p + "self_attn.v_proj.weight"] = rng.standard_normal((c["kv_heads"] * hd, d))
        t[p + "self_attn.o_proj.weight"] = rng.standard_normal((d, c["heads"] * hd))
        t[p + "mlp.gate_proj.weight"] = rng.standard_normal((c["ffn"], d))
        t[p + "mlp.up_proj.weight"] = rng.standard_normal((c["ffn"], d))
        t[p + "mlp.down_proj.weight"] = rng.standard_normal((d, c["ffn"]))
        if bias:
            t[p + "self_attn.q_proj.bias"] = rng.standard_normal(c["heads"] * hd)
            t[p + "self_attn.k_proj.bias"] = rng.standard_normal(c["kv_heads"] * hd)
            t[p + "self_attn.v_proj.bias"] = rng.standard_normal(c["kv_heads"] * hd)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.standard_normal(hd)
            t[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.standard_normal(hd)
    return {k: v.astype(np.float32) for k, v in t.items()}


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def write_tiny_gguf(path, tensors, arch="llama", permute=True, quant=None, rope_freqs=None,
                    meta_overrides=None):
    """A GGUF the way llama.cpp's converter writes one (Q/K permuted for llama), F32 tensors."""
    c = TINY
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": c["layers"], "context_length": 256, "embedding_length": c["hidden"],
        "feed_forward_length": c["ffn"], "attention.head_count": c["heads"],
        "attention.head_count_kv": c["kv_heads"], "rope.freq_base": 50000.0,
        "attention.layer_norm_rms_epsilon": 1e-5, "rope.dimension_count": c["head_dim"],
        "vocab_size": c["vocab"],
    }
    meta.update(meta_overrides or {})
    for key, value in meta.items():
        vtype = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{arch}.{key}", value, vtype)
    # a minimal byte-level tokenizer, so transformers accepts the file too
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(c["vocab"] - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in tensors.items():
        g = gguf_name(name)
        if permute and g.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, c["heads"], c["heads"])
        elif permute and g.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, c["heads"], c["kv_heads"])
        if quant is not None and t.ndim == 2 and t.shape[1] % 32 == 0:
            w.add_tensor(g, gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(g, t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6 * 8, 5)).astype(np.float32)
    for n in (1, 2, 3, 6):
        p = llama_cpp_permute(w, n)
        assert not np.array_equal(p, w)  # the permutation really moves rows
        np.testing.assert_array_equal(unpermute_qk(p, n), w)
        np.testing.assert_array_equal(permute_qk(w, n), p)
    with pytest.raises(SeerError, match="un-permute"):
        unpermute_qk(w, 5)


@pytest.mark.parametrize("tied", [True, False])
def test_synthetic_llama_round_trips_to_hf_layout(tmp_path, tied):
    hf = tiny_hf_tensors(np.random.default_rng(1), tied=tied)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    config, tensors = load_gguf(path)
    assert set(tensors) == set(hf)
    for name, want in hf.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], want, err_msg=name)
    c = TINY
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c["vocab"],
        "hidden_size": c["hidden"], "intermediate_size": c["ffn"], "num_hidden_layers": c["layers"],
        "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"],
        "head_dim": c["head_dim"], "rope_theta": 50000.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256, "tie_word_embeddings": tied, "bos_token_id": 1,
        "eos_token_id": 2,
    }


def test_quantized_tensors_are_dequantized(tmp_path):
    hf = tiny_hf_tensors(np.random.default_rng(2))
    path = write_tiny_gguf(tmp_path / "q8.gguf", hf, quant=gguf.GGMLQuantizationType.Q8_0)
    reader = open_gguf(path)
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}
    _, tensors = load_gguf(reader)
    for name, want in hf.items():
        got = tensors[name]
        assert got.shape == want.shape and got.dtype == np.float32
        # Q8_0: 8-bit codes with one scale per 32 values -> error below max|block| / 127
        tol = 1.01 * np.abs(want).max() / 127 if want.ndim == 2 and want.shape[1] % 32 == 0 else 0
        assert np.abs(got - want).max() <= tol, name


def test_qwen2_and_qwen3_are_not_unpermuted(tmp_path):
    for arch, kw in (("qwen2", dict(bias=True)), ("qwen3", dict(qk_norm=True))):
        hf = tiny_hf_tensors(np.random.default_rng(3), **kw)
        path = write_tiny_gguf(tmp_path / f"{arch}.gguf", hf, arch=arch, permute=False)
        config, tensors = load_gguf(path)
        assert config["architectures"] == [f"{arch.capitalize()}ForCausalLM"]
        assert config["attention_bias"] == (arch == "qwen2")
        assert set(tensors) == set(hf)
        for name, want in hf.items():
            np.testing.assert_array_equal(tensors[name], want, err_msg=name)


def test_synthetic_llama_matches_transformers_gguf_loader(tmp_path):
    """An independent reader of the same file: transformers' GGUF support."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = tiny_hf_tensors(np.random.default_rng(4), tied=False)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    )
    ref = {k: v.numpy() for k, v in model.state_dict().items()}
    config, tensors = load_gguf(path)
    assert set(ref) == set(tensors)
    for name, got in tensors.items():
        np.testing.assert_array_equal(got, ref[name], err_msg=name)
    for key in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
                "num_hidden_layers", "vocab_size", "max_position_embeddings"):
        assert getattr(model.config, key) == config[key], key
    assert model.config.rope_parameters["rope_theta"] == config["rope_theta"]
    assert math.isclose(model.config.rms_norm_eps, config["rms_norm_eps"], rel_tol=1e-6)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    hd, theta = TINY["head_dim"], 500000.0
    divisors = llama3_rope_divisors(params, hd, theta)
    assert divisors.min() == 1.0 and divisors.max() == 8.0  # both ends of the ramp are present
    hf = tiny_hf_tensors(np.random.default_rng(5))
    path = write_tiny_gguf(tmp_path / "l3.gguf", hf, rope_freqs=divisors,
                           meta_overrides={"rope.freq_base": theta})
    config, tensors = load_gguf(path)
    assert config["rope_scaling"] == params
    assert "rope_freqs.weight" not in tensors
    bad = write_tiny_gguf(tmp_path / "bad.gguf", hf, rope_freqs=divisors * 1.5,
                          meta_overrides={"rope.freq_base": theta})
    with pytest.raises(SeerError, match="rope_freqs"):
        load_gguf(bad)


def test_linear_rope_scaling_from_metadata(tmp_path):
    hf = tiny_hf_tensors(np.random.default_rng(6))
    w = write_tiny_gguf(tmp_path / "lin.gguf", hf, meta_overrides={"rope.scaling.factor": 4.0,
                                                                  "rope.scaling.original_context_length": 64})
    reader = gguf.GGUFReader(str(w))
    assert "rope_scaling" not in gguf_hf_config(reader)  # no type -> no scaling
    path = tmp_path / "lin2.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_key_value("llama.rope.scaling.type", "linear", gguf.GGUFValueType.STRING)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, _ = load_gguf(path)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0,
                                      "original_max_position_embeddings": 64}


def test_bad_inputs_raise_seer_error(tmp_path):
    with pytest.raises(SeerError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(SeerError, match="not a regular file"):
        load_gguf(tmp_path)
    text = tmp_path / "model.gguf"
    text.write_text("this is not a gguf file")
    with pytest.raises(SeerError, match="bad magic"):
        load_gguf(text)
    trunc = tmp_path / "trunc.gguf"
    good = write_tiny_gguf(tmp_path / "good.gguf", tiny_hf_tensors(np.random.default_rng(7)))
    trunc.write_bytes(good.read_bytes()[:100])
    with pytest.raises(SeerError, match="cannot read GGUF"):
        load_gguf(trunc)


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SeerError, match="unsupported GGUF architecture 'mamba'"):
        load_gguf(tmp_path / "mamba.gguf")


def test_metadata_and_tensor_shapes_must_agree(tmp_path):
    hf = tiny_hf_tensors(np.random.default_rng(8))
    path = write_tiny_gguf(tmp_path / "x.gguf", hf, meta_overrides={"feed_forward_length": 50})
    with pytest.raises(SeerError, match="up_proj.weight has shape"):
        load_gguf(path)


def test_tokenizer_metadata(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_tensors(np.random.default_rng(9)))
    tok = read_gguf_tokenizer(path)
    assert tok.model == "gpt2" and tok.tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(tok.tokens) == TINY["vocab"] and tok.token_types[:4] == [3, 3, 3, 1]
    assert tok.merges == ["a a"] and (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.chat_template is None and tok.add_bos_token is False


# ---- the real SmolLM2 GGUF --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path():
    return hub.fetch_smollm2()


@pytest.mark.slow
@pytest.mark.slow
def test_smollm2_matches_transformers_state_dict(smollm2_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, tensors = load_gguf(smollm2_path)
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert (config["rope_theta"], config["rms_norm_eps"]) == (100000.0, 1e-5)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    ref = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(ref) - set(tensors) == {"lm_head.weight"}  # tied: lm_head is the embedding
    assert set(tensors) <= set(ref)
    for name, got in tensors.items():
        assert got.shape == ref[name].shape, name
        assert np.abs(got - ref[name]).max() <= 1e-6, name
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    # The file's own row order differs: equality above holds only because we un-permuted.
    assert np.abs(permute_qk(q, 9) - ref["model.layers.0.self_attn.q_proj.weight"]).max() > 0.1
    assert np.abs(permute_qk(k, 3) - ref["model.layers.0.self_attn.k_proj.weight"]).max() > 0.1
