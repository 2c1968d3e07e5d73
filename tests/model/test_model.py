"""Model vs transformers, sharding, Orbax round trip, loading errors."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from seer_jax.errors import ConfigError, SeerError
from seer_jax.model.config import ModelConfig, tiny_config
from seer_jax.model.generate import full_forward
from seer_jax.model.llama import (
    flat_params,
    init_params,
    resolve_layer_weights,
    split_layers,
    stack_layers,
)
from seer_jax.model.loading import load_model, load_orbax, load_safetensors_dir, save_orbax
from seer_jax.model.sharding import make_mesh, shard_params

torch = pytest.importorskip("torch")
from tests.model.hf_models import make_hf_model  # noqa: E402


@pytest.fixture(scope="module", params=["llama3", "qwen2", "qwen3", "llama_tied"])
def hf_model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make_hf_model(request.param, d)


def test_logits_match_transformers_ragged_batch(hf_model):
    kind, path, ref_model = hf_model
    cfg, params = load_safetensors_dir(path)
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert (cfg.rope_scaling is not None) == (kind == "llama3")
    assert cfg.tie_word_embeddings == (kind == "llama_tied")
    rng = np.random.RandomState(1)
    lens = [37, 12, 25]
    toks = np.zeros((3, max(lens)), np.int64)
    mask = np.zeros_like(toks)
    for i, n in enumerate(lens):
        toks[i, :n] = rng.randint(0, cfg.vocab_size, n)
        mask[i, :n] = 1
    ours = np.asarray(full_forward(params, cfg, toks))
    with torch.no_grad():
        ref = ref_model(torch.tensor(toks), attention_mask=torch.tensor(mask)).logits.numpy()
    for i, n in enumerate(lens):
        np.testing.assert_allclose(ours[i, :n], ref[i, :n], atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_sharded_logits_equal_unsharded(tp):
    cfg = tiny_config(num_heads=8, num_kv_heads=4)
    params = init_params(cfg, seed=3)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 17))
    ref = np.asarray(full_forward(params, cfg, toks))
    mesh = make_mesh(jax.devices()[:tp])
    sharded = shard_params(params, mesh)
    wq = sharded["layers"]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    assert len(wq.addressable_shards) == tp
    assert wq.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size, cfg.q_size // tp)
    assert sharded["layers"]["w_down"].addressable_shards[0].data.shape[1] == cfg.intermediate_size // tp
    # embedding and LM head along the vocabulary
    assert sharded["embed"].sharding.spec == jax.sharding.PartitionSpec("tp", None)
    assert sharded["lm_head"].addressable_shards[0].data.shape == (cfg.hidden_size, cfg.vocab_size // tp)
    out = np.asarray(full_forward(sharded, cfg, toks))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_per_layer_weights_give_the_stacked_logits_and_shard_like_one_layer():
    """Layers held as a tuple of per-layer dicts (as engines hold them on GPUs): the same
    logits as the stacked weights' scan, sharded over tp like one layer of the stack."""
    cfg = tiny_config(num_heads=8, num_kv_heads=4, qkv_bias=True)
    params = init_params(cfg, seed=3)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 17))
    ref = np.asarray(full_forward(params, cfg, toks))
    split = split_layers(params)
    assert len(split["layers"]) == cfg.num_layers
    for i, lp in enumerate(split["layers"]):
        for k, v in lp.items():
            assert np.array_equal(np.asarray(v), np.asarray(params["layers"][k][i])), (i, k)
    mesh = make_mesh(jax.devices()[:2])
    sharded = shard_params(split, mesh)
    wq, w_down = sharded["layers"][1]["wq"], sharded["layers"][1]["w_down"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert w_down.addressable_shards[0].data.shape == (cfg.intermediate_size // 2, cfg.hidden_size)
    assert sharded["layers"][0]["bk"].sharding.spec == jax.sharding.PartitionSpec("tp")
    np.testing.assert_allclose(np.asarray(full_forward(sharded, cfg, toks)), ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(full_forward(split, cfg, toks)), ref, atol=1e-5, rtol=0)
    back = flat_params(stack_layers(split))
    assert back.keys() == flat_params(params).keys()
    for k, v in flat_params(params).items():
        assert np.array_equal(np.asarray(back[k]), np.asarray(v)), k
    with pytest.raises(ValueError, match="per-layer weight dicts"):
        full_forward({**split, "layers": split["layers"][:-1]}, cfg, toks)
    with pytest.raises(ValueError, match="stacked layers"):
        flat_params(split)
    assert resolve_layer_weights("auto", "gpu") == "per_layer"
    assert resolve_layer_weights("auto", "tpu") == resolve_layer_weights("auto", "cpu") == "stacked"
    assert resolve_layer_weights("per_layer", "cpu") == "per_layer"
    with pytest.raises(ConfigError, match="layer_weights='scanned'"):
        resolve_layer_weights("scanned", "gpu")


def test_orbax_round_trip_bit_identical(tmp_path):
    cfg = tiny_config(qkv_bias=True)
    params = init_params(cfg, seed=5)
    save_orbax(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = load_orbax(tmp_path / "ckpt")
    assert cfg2 == cfg
    a, b = flat_params(params), flat_params(params2)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    # and load_model dispatches to it
    cfg3, _ = load_model(tmp_path / "ckpt")
    assert cfg3 == cfg


def test_bf16_close_to_f32():
    cfg = tiny_config()
    params = init_params(cfg, seed=2)
    cfg16 = cfg.with_dtype("bfloat16")
    p16 = jax.tree.map(lambda x: x.astype("bfloat16"), params)
    toks = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 9))
    a = np.asarray(full_forward(params, cfg, toks))
    b = np.asarray(full_forward(p16, cfg16, toks))
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()


# ---------------------------------------------------------------------------- bad input


def test_missing_path():
    with pytest.raises(SeerError, match="does not exist|not found|no such"):
        load_model("/nonexistent/model/dir")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SeerError, match="GPT2LMHeadModel.*not supported"):
        load_model(tmp_path)


def test_pickle_checkpoint_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(SeerError, match="pickle"):
        load_model(tmp_path)
    with pytest.raises(SeerError, match="pickle"):
        load_model(tmp_path / "pytorch_model.bin")


def test_shape_mismatch_between_config_and_weights(tmp_path):
    path = tmp_path / "orig"
    make_hf_model("llama3", path)
    tmp_path = tmp_path / "bad"
    tmp_path.mkdir()
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json["intermediate_size"] = 128
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises(SeerError, match="shape mismatch.*w_gate|shape mismatch.*w_up"):
        load_model(tmp_path)


def test_bad_config_values():
    with pytest.raises(SeerError, match="num_kv_heads"):
        tiny_config(num_heads=4, num_kv_heads=3)
    with pytest.raises(SeerError, match="dtype"):
        tiny_config(dtype="float16")
    assert isinstance(tiny_config(), ModelConfig)


def test_bfloat16_checkpoint_loads_its_exact_values(tmp_path):
    """Released checkpoints are mostly bfloat16."""
    model = make_hf_model("qwen3", tmp_path / "f32").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", safe_serialization=True)
    cfg, params = load_safetensors_dir(tmp_path / "bf16")
    want = flat_params(load_safetensors_dir(tmp_path / "f32")[1])
    got = flat_params(params)
    assert got.keys() == want.keys()
    for k in want:  # the f32 weights rounded to bfloat16 and back
        np.testing.assert_array_equal(np.asarray(got[k]),
                                      np.asarray(want[k]).astype(jax.numpy.bfloat16).astype(np.float32),
                                      err_msg=k)


def test_rope_per_half_equals_rotate_half():
    """`apply_rope`'s per-half products equal HF's x * cos + rotate_half(x) * sin on the
    model's tables (equal halves), in float32 and bfloat16."""
    import jax.numpy as jnp

    from seer_jax.model.llama import apply_rope, rope_cos_sin

    cfg = tiny_config()
    cos, sin = rope_cos_sin(jnp.arange(37) * 13, cfg)
    x = np.random.RandomState(0).randn(37, cfg.num_heads, cfg.head_dim).astype(np.float32)
    half = cfg.head_dim // 2
    for dtype in (jnp.float32, jnp.bfloat16):
        xd = jnp.asarray(x, dtype)
        xf = xd.astype(jnp.float32)
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
        ref = (xf * cos[:, None] + rotated * sin[:, None]).astype(dtype)
        got = apply_rope(xd, cos, sin)
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                   rtol=1e-6, atol=1e-6)
