"""The tiny random checkpoint writer: loads back exactly (sharded), transformers reads it the
same, and `seer-jax generate` runs on it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from seer_jax.cli import main
from seer_jax.model.llama import flat_params, init_params
from seer_jax.model.loading import load_safetensors_dir
from seer_jax.model.tiny_checkpoint import tiny_model_config, write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen3moe", shards=2)


def test_sharded_checkpoint_loads_back_exactly(tiny_moe):
    assert sorted(p.name for p in tiny_moe.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    cfg, params = load_safetensors_dir(tiny_moe)
    assert cfg == tiny_model_config("Qwen3MoeForCausalLM")
    want = flat_params(init_params(cfg, 0))
    got = flat_params(params)
    assert got.keys() == want.keys()
    for k in want:
        assert np.array_equal(np.asarray(got[k]), np.asarray(want[k])), k


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "deepseek",
                                 arch="DeepseekV3ForCausalLM")


@pytest.mark.parametrize("which", ["qwen3_moe", pytest.param("deepseek_v3",
                                                             marks=pytest.mark.exhaustive)])
def test_generate_command_equals_transformers(request, which, capsys):
    torch = pytest.importorskip("torch")
    import transformers as tf

    tiny_moe = request.getfixturevalue("tiny_moe" if which == "qwen3_moe" else "tiny_deepseek")
    if which == "deepseek_v3":  # latent attention, YaRN, sigmoid group-limited routing
        cfg, _ = load_safetensors_dir(tiny_moe)
        assert cfg == tiny_model_config("DeepseekV3ForCausalLM")
    prompt = "Hello, experts"
    assert main(["generate", "--model", str(tiny_moe), "--prompt", prompt, "--max-tokens", "12",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == list(prompt.encode())  # the byte tokenizer
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_moe).eval()
    ids = torch.tensor([out["prompt_ids"]])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert out["token_ids"] == ref[0, ids.shape[1]:].tolist()
    assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length"
