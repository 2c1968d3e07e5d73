"""GRPO with Tunix's GRPOLearner on a verifiable task (single-digit addition, exact reward),
with Tunix's own rollout or seer_jax's, on CPU.

    python examples/grpo_tunix.py                                  # SeerRollout, 1 slice
    python examples/grpo_tunix.py --engine vanilla                 # Tunix's VanillaRollout
    python examples/grpo_tunix.py --engine seer --slices 2 --steps 10 --out /tmp/grpo
    python examples/grpo_tunix.py --rollout-dtype bfloat16         # bf16 rollout, f32 trainer

The policy is a small random Tunix Llama3 over a character tokenizer; the prompts are "a+b=" and
the reward is 1 for the exact sum followed by EOS plus 0.5 for a digit where the answer goes.
Every step prints the reward, the policy version the rollout served (it equals the trainer step),
the rollout / train / sync seconds and the rollout-vs-trainer logprob mismatch on the sampled
tokens. Tunix writes Orbax checkpoints under OUT/tunix after every step; running again with the
same --out resumes from the last one (and stops at once if it already holds --steps steps).
Writes OUT/grpo_tunix.json (a top-level `summary`, the settings and every step). A reward
function (--reward) that raises or returns NaN or the wrong number of rewards stops the run with
an error naming the step and the prompt, exit status 2, the checkpoint of the last step kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv):
    from seer_jax.integrations.tunix_grpo import GrpoSettings

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    for f in dataclasses.fields(GrpoSettings):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(flag, type=kind, default=f.default)
    p.set_defaults(out="/tmp/seer_grpo_tunix")
    p.add_argument("--reward", default="",
                   help="a reward function instead of the addition score: MODULE:NAME or "
                        "FILE.py:NAME, called as fn(prompts, completions, answer=...) -> floats")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    return p.parse_args(argv)


def load_reward(spec: str):
    import importlib
    import importlib.util

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise SystemExit(f"--reward={spec!r}: expected MODULE:NAME or FILE.py:NAME")
    if where.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location(pathlib.Path(where).stem, where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def step_line(h: dict) -> str:
    m = h.get("mismatch", {})
    mm = f"  |dlogp| max {m['max_abs']:.1e} mean {m['mean_abs']:.1e}" if m else ""
    return (f"step {h['step']:4d}  policy v{h['policy_version']}  reward {h['mean_reward']:.3f}  "
            f"exact {h['exact']:.2f}  rollout {h['rollout_s']:.3f}s  train {h['train_s']:.3f}s  "
            f"sync {h['sync_s']:.3f}s{mm}  sample {h['sample']!r}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from seer_jax.errors import SeerError
    from seer_jax.integrations.tunix_grpo import GrpoRun, GrpoSettings

    s = GrpoSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(GrpoSettings)})
    out = pathlib.Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    reward = load_reward(args.reward) if args.reward else None
    try:
        run = GrpoRun(s, reward, on_step=None if args.quiet else (lambda h: print(step_line(h), flush=True)))
    except SeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if run.restored_step:
        print(f"resumed from {out / 'tunix'} at trainer step {run.restored_step}")
    error = None
    try:
        run.train()
    except SeerError as e:
        error = str(e)
    report = run.report()
    report["error"] = error
    (out / "grpo_tunix.json").write_text(json.dumps(report, indent=1))
    if error:
        print(f"error: {error}", file=sys.stderr)
        print(f"stopped after trainer step {run.trainer_step()}; its checkpoint is kept under "
              f"{out / 'tunix'} (run again with the same --out to resume)", file=sys.stderr)
        return 2
    print(json.dumps(report["summary"], indent=1))
    return 0 if report["summary"]["versions_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
