"""CLI: bad input gives one clear error line, no traceback."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from seer_jax.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "seer_jax.cli", *args], capture_output=True, text=True)


def test_unknown_flag_value_is_one_clear_error():
    r = run_cli("generate", "--prompt", "x", "--dtype", "float16")
    assert r.returncode == 2
    assert "invalid choice: 'float16'" in r.stderr and "Traceback" not in r.stderr


def test_unknown_flag():
    r = run_cli("generate", "--prompt", "x", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/no/such/model", "--prompt", "hi"], "/no/such/model"),
        (["--prompt-ids", "1,x,3"], "--prompt-ids must be comma-separated integers"),
        (["--prompt-ids", "1,2", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    ],
)
@pytest.mark.slow
def test_bad_generate_input(args, message, capsys):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_prompt_longer_than_context(tmp_path, capsys):
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params
    from seer_jax.model.loading import save_orbax

    cfg = tiny_config(max_position_embeddings=32)
    save_orbax(tmp_path / "m", cfg, init_params(cfg))
    ids = ",".join(["5"] * 30)
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-ids", ids, "--max-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model context of 32" in err
    # within context it works and emits JSON
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-ids", "5,6,7",
                 "--max-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 4 and out["run"]["commit"] and "jax" in out["run"]["packages"]


def write_tiny_hf_llama(out: pathlib.Path, seed: int = 0) -> None:
    """A tiny random Llama checkpoint in the HF layout (config.json, model.safetensors) and no
    tokenizer files."""
    import numpy as np
    from safetensors.numpy import save_file

    h, inter, layers, heads, kv, vocab = 64, 96, 2, 4, 2, 160
    d = h // heads
    rng = np.random.default_rng(seed)
    w = lambda *shape: (0.1 * rng.standard_normal(shape)).astype(np.float32)
    tensors = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": 1 + w(h),
               "lm_head.weight": w(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
            p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter)})
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "float32"}))


def test_generate_prompt_ids_on_a_checkpoint_without_a_tokenizer(tmp_path, capsys):
    """Token ids in, token ids out (the model's greedy ones); no text without a tokenizer, and
    a text prompt still needs one."""
    from seer_jax.model.generate import generate
    from seer_jax.model.loading import load_model

    model = tmp_path / "m"
    write_tiny_hf_llama(model)
    assert main(["generate", "--model", str(model), "--prompt-ids", "5,6,7", "--max-tokens", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg, params = load_model(model, "float32")
    want = generate(params, cfg, [[5, 6, 7]], 3, eos_ids=tuple(cfg.eos_token_ids))[0]
    assert out["token_ids"] == want.token_ids and out["text"] is None
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_check_deploy_without_compilers_says_how_to_install_them(capsys):
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed here: --compile would compile")
    config = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tpu_v5p64_qwen25_7b.py"
    assert main(["check-deploy", str(config), "--compile"]) == 2
    err = capsys.readouterr().err
    assert "libtpu is not installed" in err and "pip install 'seer-jax[hardware]'" in err


def test_check_deploy_json_carries_the_layout_and_the_run(capsys):
    config = pathlib.Path(__file__).resolve().parents[2] / "configs" / "tpu_v5p64_qwen25_7b.py"
    assert main(["check-deploy", str(config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"] == {"config": "tpu_v5p64_qwen25_7b", "valid": True, "compiled": False,
                              "fits": None, "max_peak_gib": 0.0}
    assert out["layout"]["tp"] == 4 and out["run"]["command"]
    assert main(["check-deploy", str(config), "--config.mesh.chip=v9"]) == 2
    assert "unknown accelerator 'v9'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_profile_writes_a_loadable_step_profile(tmp_path):
    from seer_jax.costs import StepProfile
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params
    from seer_jax.model.loading import save_orbax

    cfg = tiny_config()
    save_orbax(tmp_path / "m", cfg, init_params(cfg))
    out = tmp_path / "profile.json"
    assert main(["bench", "--profile", "--model", str(tmp_path / "m"), "--batch-sizes", "1,4",
                 "--gammas", "0,2", "--context", "20", "--iters", "1", "--json", str(out)]) == 0
    assert "commit" in json.loads(out.read_text())["run"]
    profile = StepProfile.load(out)
    assert len(profile.points) == 4
    assert {(p.batch_size, p.gamma) for p in profile.points} == {(1, 0), (1, 2), (4, 0), (4, 2)}
    assert all(p.step_s > 0 for p in profile.points)
