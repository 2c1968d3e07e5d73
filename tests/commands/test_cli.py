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
