"""Partial rollout across iterations on the AIME trace in the simulator (configs/sim/r1_aime.py):
carry-over (`target_groups`, over-provisioned) against waiting for every group, over several
training iterations with a weight sync between each (`seer_jax.sim.partial`).

    python benchmarks/partial_rollout.py [--iterations 5] [--groups 400] [--oversubscription 1.25]
        [--policy seer] [--seed 0] [--warmup 1] [--json benchmarks/results/partial_rollout.json]
        [--config.key=value ...]

JSON: command, commit, versions (`run`), per-iteration rows of both modes, and a top-level
`summary`: per mode tokens/s, groups/s, off-policy share and age of the off-policy tokens (in
weight versions), over the iterations after the warm-up, and carry-over's ratios.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/sim/r1_aime.py"))
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--groups", type=int, default=400, help="groups handed to the trainer per iteration")
    ap.add_argument("--oversubscription", type=float, default=1.25)
    ap.add_argument("--policy", default="seer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="iterations left out of the summary")
    ap.add_argument("--json", default="benchmarks/results/partial_rollout.json")
    args, overrides = ap.parse_known_args(argv)
    from seer_jax.analysis.policies import CATALOG
    from seer_jax.config_files import load_config_file
    from seer_jax.provenance import run_info
    from seer_jax.sim.partial import simulate_iterations

    info = run_info()
    cfg = load_config_file(args.config, overrides)
    modes = {}
    for carry in (False, True):
        run = simulate_iterations(cfg, args.policy, iterations=args.iterations,
                                  groups_per_iteration=args.groups, carry_over=carry,
                                  seed=args.seed, oversubscription=args.oversubscription,
                                  catalog=CATALOG)
        name = "carry_over" if carry else "wait_for_all"
        modes[name] = {"summary": run.summary(skip=args.warmup), "iterations": run.iterations,
                       "sim_wall_s": run.wall_s}
        print(name, json.dumps(modes[name]["summary"]), flush=True)
    a, b = modes["wait_for_all"]["summary"], modes["carry_over"]["summary"]
    summary = {
        "config": args.config, "overrides": overrides, "policy": args.policy,
        "groups_per_iteration": args.groups, "oversubscription": args.oversubscription,
        "iterations": args.iterations, "warmup_iterations": args.warmup, "seed": args.seed,
        "wait_for_all": a, "carry_over": b,
        "tokens_per_s_ratio": b["tokens_per_s"] / a["tokens_per_s"],
        "groups_per_s_ratio": b["groups_per_s"] / a["groups_per_s"],
        "off_policy_share": b["off_policy_share"],
        "mean_age_of_off_policy_tokens": b["mean_age_of_off_policy_tokens"],
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run": info, "summary": summary, "modes": modes}, indent=1,
                                   default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
