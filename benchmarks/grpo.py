"""The same GRPO job with Tunix's rollout (`VanillaRollout`) and with seer_jax's (`SeerRollout`, 1
and 2 in-process slices): reward per step and per second, rollout / train / sync seconds per
iteration, rollout tokens/s, and the rollout-vs-trainer logprob mismatch, over several seeds.

    python benchmarks/grpo.py [--steps 60] [--seeds 0,1,2] [--engines vanilla,seer1,seer2@0]
        [--bf16-steps 10] [--json benchmarks/results/grpo.json] [--plot docs/img/grpo_reward.png]

The job (seer_jax.integrations.tunix_grpo): Tunix's GRPOLearner trains a small random Tunix
Llama3 (character tokenizer) on single-digit addition with an exact reward; the trainer on one
device, the rollout on its own devices, weights synced after every step. Every engine sees the
same model, prompts and sampling seeds. All runs share one process, so the first run of an engine
pays its compiles (reported apart as `first_step_s`); per-iteration times are medians over the
steps after the first, and the reward-vs-time curve starts after the first step.
`--bf16-steps` adds one shorter run per engine with the rollout's weights in bfloat16 (the
trainer stays float32), for the mismatch.

JSON: `run` (command, commit, versions), `summary` (per engine: rewards at the start and end
averaged over seeds, exact-answer share, median seconds per iteration and its parts, tokens/s,
the mismatch in float32 and bfloat16, and each engine's iteration-time ratio to vanilla), and
every run's per-step rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {"vanilla": ("vanilla", 1), "seer1": ("seer", 1), "seer2": ("seer", 2)}


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(runs: list[dict], window: int) -> dict:
    """One engine's runs (float32, several seeds) -> averages over seeds."""
    steps = [r["steps"] for r in runs]

    def avg(key, part):
        return _mean([_mean([h[key] for h in part(s)]) for s in steps])

    return {
        "seeds": [r["summary"]["seed"] for r in runs], "steps": len(steps[0]),
        "reward_first": avg("mean_reward", lambda s: s[:window]),
        "reward_last": avg("mean_reward", lambda s: s[-window:]),
        "exact_first": avg("exact", lambda s: s[:window]),
        "exact_last": avg("exact", lambda s: s[-window:]),
        "first_step_s": _mean([s[0]["rollout_s"] + s[0]["train_s"] + s[0]["sync_s"] for s in steps]),
        **{f"{k}_median": _mean([r["summary"][f"{k}_median"] for r in runs])
           for k in ("rollout_s", "train_s", "sync_s", "iteration_s", "tokens_per_s")},
        "wall_s_after_first_step": _mean([s[-1]["wall_s"] - s[0]["wall_s"] for s in steps]),
        "versions_match": all(r["summary"]["versions_match"] for r in runs),
        "mismatch_float32": _mismatch(runs),
    }


def _mismatch(runs: list[dict]) -> dict | None:
    mm = [r["summary"].get("mismatch") for r in runs if r["summary"].get("mismatch")]
    if not mm:
        return None
    return {"max_abs": max(m["max_abs"] for m in mm), "mean_abs": _mean([m["mean_abs"] for m in mm]),
            "equal_share": _mean([m["equal_share"] for m in mm]), "k1": _mean([m["k1"] for m in mm]),
            "k3": _mean([m["k3"] for m in mm]), "tokens": sum(m["tokens"] for m in mm)}


def plot(per_engine: dict[str, list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in per_engine.items():
        r = np.array([[h["mean_reward"] for h in run["steps"]] for run in runs])
        k = max(1, r.shape[1] // 20)  # moving average over k steps
        smooth = np.array([np.convolve(x, np.ones(k) / k, mode="valid") for x in r])
        x = np.arange(smooth.shape[1]) + k - 1
        line, = a.plot(x, smooth.mean(0), label=name)
        a.fill_between(x, smooth.min(0), smooth.max(0), alpha=0.2, color=line.get_color())
        for run in runs:  # reward against seconds since the end of the first step
            t = np.array([h["wall_s"] for h in run["steps"]])
            y = np.array([h["mean_reward"] for h in run["steps"]])
            t = t - t[0]
            ys = np.convolve(y, np.ones(k) / k, mode="valid")
            b.plot(t[k - 1:], ys, color=line.get_color(), alpha=0.7,
                   label=name if run is runs[0] else None)
    a.set_xlabel("GRPO step")
    a.set_ylabel("mean reward (moving avg; band: seeds min-max)")
    b.set_xlabel("seconds after the first step (rollout + train + sync)")
    b.set_ylabel("mean reward (moving average)")
    b.set_xscale("symlog", linthresh=1.0)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO on single-digit addition, Tunix GRPOLearner, 2-core CPU")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--engines", default="vanilla,seer1,seer2@0",
                    help=f"of {list(VARIANTS)}; NAME@S1+S2 runs NAME with those seeds only")
    ap.add_argument("--bf16-steps", type=int, default=10, help="0: no bfloat16 runs")
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--window", type=int, default=10, help="steps averaged for first/last reward")
    ap.add_argument("--json", default="benchmarks/results/grpo.json")
    ap.add_argument("--plot", default="docs/img/grpo_reward.png")
    ap.add_argument("--replot", default="", help="only redraw --plot from this JSON")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(pathlib.Path(args.replot).read_text())["runs"], pathlib.Path(args.plot))
        return 0
    from seer_jax.integrations.tunix_grpo import GrpoSettings, run_grpo
    from seer_jax.provenance import run_info

    info = run_info()
    seeds = [int(x) for x in args.seeds.split(",")]
    engines = {}  # name -> seeds; "seer2@0" runs seer2 with seed 0 only
    for item in args.engines.split(","):
        name, _, own = item.partition("@")
        if name not in VARIANTS:
            raise SystemExit(f"--engines: {name!r} is not one of {list(VARIANTS)}")
        engines[name] = [int(x) for x in own.split("+")] if own else seeds
    per_engine: dict[str, list[dict]] = {}
    bf16: dict[str, dict] = {}
    t0 = time.perf_counter()
    for name, engine_seeds in engines.items():
        engine, slices = VARIANTS[name]
        for seed in engine_seeds:
            r = run_grpo(GrpoSettings(engine=engine, slices=slices, steps=args.steps, seed=seed,
                                      learning_rate=args.learning_rate))
            per_engine.setdefault(name, []).append(r)
            s = r["summary"]
            print(f"{name} seed {seed}: reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}  "
                  f"iteration {s['iteration_s_median']:.3f}s  ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
        if args.bf16_steps:
            bf16[name] = run_grpo(GrpoSettings(engine=engine, slices=slices, steps=args.bf16_steps,
                                               seed=engine_seeds[0], learning_rate=args.learning_rate,
                                               rollout_dtype="bfloat16"))
    summary = {"steps": args.steps, "seeds": {k: v for k, v in engines.items()}, "learning_rate": args.learning_rate,
               "task": "single-digit addition a+b (0<=a,b<=4), reward: exact 1 + closeness 0.5",
               "engines": {}}
    for name, runs in per_engine.items():
        e = summarize(runs, args.window)
        e["mismatch_bfloat16"] = bf16[name]["summary"].get("mismatch") if name in bf16 else None
        summary["engines"][name] = e
    base = summary["engines"].get("vanilla")
    if base:
        for e in summary["engines"].values():
            e["iteration_s_vs_vanilla"] = e["iteration_s_median"] / base["iteration_s_median"]
            e["rollout_s_vs_vanilla"] = e["rollout_s_median"] / base["rollout_s_median"]
    for e in summary["engines"].values():  # reward gained per second of training after step 0
        e["reward_gain_per_s"] = (e["reward_last"] - e["reward_first"]) / e["wall_s_after_first_step"]
    summary["total_s"] = time.perf_counter() - t0
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run": info, "summary": summary,
                                    "runs": {k: v for k, v in per_engine.items()},
                                    "bfloat16_runs": bf16}, indent=1, default=str) + "\n")
    head = (f"{'engine':8s} {'reward first->last':>18s} {'exact':>11s} {'iter s':>7s} {'rollout':>8s} "
            f"{'train':>6s} {'sync':>6s} {'tok/s':>7s} {'first s':>7s} {'f32 max|d|':>10s} {'bf16 max|d|':>11s}")
    print(head)
    for name, e in summary["engines"].items():
        m32, m16 = e["mismatch_float32"] or {}, e["mismatch_bfloat16"] or {}
        print(f"{name:8s} {e['reward_first']:8.3f} -> {e['reward_last']:6.3f} "
              f"{e['exact_first']:4.2f}->{e['exact_last']:4.2f} {e['iteration_s_median']:7.3f} "
              f"{e['rollout_s_median']:8.3f} {e['train_s_median']:6.3f} {e['sync_s_median']:6.3f} "
              f"{e['tokens_per_s_median']:7.0f} {e['first_step_s']:7.1f} "
              f"{m32.get('max_abs', float('nan')):10.2e} {m16.get('max_abs', float('nan')):11.2e}")
    if args.plot:
        plot(per_engine, pathlib.Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
