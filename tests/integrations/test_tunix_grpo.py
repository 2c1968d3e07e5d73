"""The GRPO job (seer_jax.integrations.tunix_grpo, examples/grpo_tunix.py): Tunix's GRPOLearner
with Tunix's VanillaRollout and with SeerRollout, policy versions, checkpoint resume, the
rollout/trainer mismatch metrics and bad reward functions."""

import importlib.util
import json
import math
import pathlib

import numpy as np
import pytest

from seer_jax.errors import ConfigError, InputError

pytest.importorskip("tunix")

from seer_jax.integrations.tunix_grpo import (  # noqa: E402
    GrpoSettings,
    checked_reward,
    mismatch_stats,
    score,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the smallest job: a 1-layer 32-wide model, 2 prompts x 4 samples, 2 tokens
TINY = dict(num_layers=1, embed_dim=32, hidden_dim=32, prompts_per_step=2, group_size=4,
            max_tokens=2)


def test_score_is_exact_plus_closeness():
    assert score("7", "7") == 1.5 and score(" 7x", "7") == 1.5
    assert score("77", "7") == 0.0  # 77 is far from 7 and not the answer
    assert score("5", "7") == 0.5 * 0.8 and score("x7", "7") == 0.0 and score("", "7") == 0.0


def test_checked_reward_names_step_prompt_and_completion():
    prompts, comps = ["1+2=", "3+4="], ["3", "x"]

    def raises(prompts, completions, **_):
        raise KeyError("answer")

    def nan(prompts, completions, **_):
        return [1.0, float("nan")]

    def short(prompts, completions, **_):
        return [1.0]

    def text(prompts, completions, **_):
        return ["a", "b"]

    with pytest.raises(InputError, match=r"'raises' raised at step 3 .*'1\+2=': KeyError"):
        checked_reward(raises, lambda: 3)(prompts, comps)
    with pytest.raises(InputError, match=r"'nan' at step 5 returned nan for prompt 1 '3\+4=' "
                                         r"\(completion 'x'\)"):
        checked_reward(nan, lambda: 5)(prompts, comps)
    with pytest.raises(InputError, match=r"'short' at step 0 returned shape \(1,\) for 2 completions"):
        checked_reward(short, lambda: 0)(prompts, comps)
    with pytest.raises(InputError, match="not numbers"):
        checked_reward(text, lambda: 0)(prompts, comps)
    ok = checked_reward(lambda prompts, completions, **_: [1, 2], lambda: 0)(prompts, comps)
    assert ok.dtype == np.float32 and ok.tolist() == [1.0, 2.0]


def test_mismatch_stats():
    rollout = np.array([[-1.0, -2.0, -3.0], [-0.5, -9.0, 0.0]])
    trainer = np.array([[-1.0, -2.5, -3.0], [-0.25, 7.0, 0.0]])
    mask = np.array([[True, True, True], [True, False, False]])
    m = mismatch_stats(rollout, trainer, mask)
    d = np.array([0.0, 0.5, 0.0, -0.25])
    assert m["tokens"] == 4 and m["max_abs"] == 0.5 and m["mean_abs"] == pytest.approx(0.1875)
    assert m["equal_share"] == 0.5 and m["k1"] == pytest.approx(d.mean())
    assert m["k3"] == pytest.approx(np.mean(np.exp(-d) - 1 + d)) and m["k3"] > 0
    with pytest.raises(ConfigError, match="slices=2: Tunix's VanillaRollout"):
        GrpoSettings(engine="vanilla", slices=2).validate()
    with pytest.raises(ConfigError, match="engine='vllm'"):
        GrpoSettings(engine="vllm").validate()


def _example():
    spec = importlib.util.spec_from_file_location("grpo_tunix_example", ROOT / "examples" / "grpo_tunix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flags(**kw):
    flags = []
    for k, v in {**TINY, **kw}.items():
        name = k.replace("_", "-")
        flags.append((f"--{name}" if v else f"--no-{name}") if isinstance(v, bool) else f"--{name}={v}")
    return flags + ["--quiet"]


def _check_steps(steps, first, n):
    """Steps first..first+n-1: the rollout served version k at trainer step k and k+1 after the
    sync that followed; the mismatch against the trainer's own forward on every sampled token."""
    assert [h["step"] for h in steps] == [h["policy_version"] for h in steps] == list(range(first, first + n))
    assert [h["version_after_sync"] for h in steps] == [h["trainer_step_after_sync"] for h in steps]
    assert [h["version_after_sync"] for h in steps] == list(range(first + 1, first + n + 1))
    for h in steps:
        m = h["mismatch"]
        assert m["tokens"] > 0 and 0.0 <= m["equal_share"] <= 1.0
        assert 0.0 <= m["max_abs"] < 1e-4  # float32 rollout and trainer
        assert math.isfinite(m["k1"]) and m["k3"] >= 0.0


FLAKY = ("calls = []\n"
         "def flaky(prompts, completions, **_):\n"
         "    calls.append(1)\n"
         "    return [float('nan') if len(calls) == 3 else 1.0 for _ in completions]\n")


@pytest.mark.slow
def test_example_vanilla_bad_reward_stops_keeps_checkpoint_and_resumes(tmp_path, capsys):
    example, out = _example(), tmp_path / "run"
    (tmp_path / "rewards.py").write_text(FLAKY)
    flags = _flags(engine="vanilla", steps=3, out=out)
    assert example.main(flags + [f"--reward={tmp_path / 'rewards.py'}:flaky"]) == 2
    err = capsys.readouterr().err
    assert "error: reward function 'flaky' at step 2 returned nan for prompt 0 '" in err
    assert "stopped after trainer step 2; its checkpoint is kept" in err
    report = json.loads((out / "grpo_tunix.json").read_text())
    assert "at step 2" in report["error"]
    _check_steps(report["steps"], 0, 2)
    # a new job resumes at step 2 with the rollout at version 2
    assert example.main(flags) == 0
    report = json.loads((out / "grpo_tunix.json").read_text())
    _check_steps(report["steps"], 2, 1)
    assert report["summary"]["final_policy_version"] == report["summary"]["trainer_steps"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("slices", [1, pytest.param(2, marks=pytest.mark.exhaustive)])
def test_example_seer_steps_and_resume(tmp_path, slices):
    example = _example()
    assert example.main(_flags(engine="seer", slices=slices, steps=2, out=tmp_path)) == 0
    report = json.loads((tmp_path / "grpo_tunix.json").read_text())
    _check_steps(report["steps"], 0, 2)
    assert report["summary"]["versions_match"] and report["summary"]["final_policy_version"] == 2
    # resume: the trainer restores step 2, the engines get its weights and report version 2
    assert example.main(_flags(engine="seer", slices=slices, steps=3, out=tmp_path)) == 0
    report = json.loads((tmp_path / "grpo_tunix.json").read_text())
    _check_steps(report["steps"], 2, 1)
    assert report["summary"]["final_policy_version"] == 3
