"""Scheduling on a real reasoning-model length trace: configs/sim/r1_aime.py (DeepSeek-R1-
Distill-Qwen-1.5B on AIME, 400 groups resampled per seed, Moonlight cluster shape), every policy
on several resampling seeds, and the ablation ladder on one seed.

    .venv/bin/python benchmarks/real_trace.py [--seeds 0,1,2,3] [--json PATH]
        [--policies group_round_robin,request_fcfs,seer,oracle_group_lfs,oracle_lfs]
        [--config.key=value ...]

Writes JSON with the exact command, git commit, package versions, per-seed runs and a top-level
`summary`: per policy mean tokens_per_s and `seer_tokens_per_s_ratio_vs_<policy>` (mean, min,
max over seeds), and `ablation` (group_round_robin -> request_fcfs -> seer -> seer + grouped SD,
seed = the config's) with `tokens_per_s_ratio_vs_group_round_robin`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import time
from importlib import metadata

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from seer_jax.analysis.policies import CATALOG  # noqa: E402
from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.sim import simulator as sim  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_POLICIES = "group_round_robin,request_fcfs,seer,oracle_group_lfs,oracle_lfs"


def provenance(argv: list[str]) -> dict:
    """The command, the git commit (and whether the tree was dirty) and package versions."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""
    versions = {}
    for pkg in ("numpy", "ml_collections", "jax"):
        try:
            versions[pkg] = metadata.version(pkg.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"command": " ".join(["python", *argv]), "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "python": platform.python_version(), "packages": versions}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs/sim/r1_aime.py"))
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--policies", default=DEFAULT_POLICIES)
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--json", default="benchmarks/results/real_trace/r1_aime.json")
    args, overrides = ap.parse_known_args()
    prov = provenance(sys.argv)  # the code that runs, before anything can change the tree
    cfg = load_config_file(args.config, overrides)
    sim.validate_config(cfg, CATALOG)
    pols = sim.policy_list(args.policies, CATALOG)
    seeds = [int(s) for s in args.seeds.split(",")]
    per_seed: dict[int, dict] = {}
    for sd in seeds:
        work = sim.build_workload(cfg, seed=sd)
        rows = {}
        for p in pols:
            t = time.perf_counter()
            rows[p] = sim.simulate(cfg, p, workload=work, catalog=CATALOG).row()
            r = rows[p]
            print(f"seed {sd} {p:18s} {r['tokens_per_s']:10,.0f} tok/s  makespan "
                  f"{r['makespan_s']:6.1f} s  tail {r['tail_s']:5.1f} s  idle "
                  f"{r['idle_fraction']:.1%}  ({time.perf_counter() - t:.0f} s)", flush=True)
        per_seed[sd] = rows
    config = pathlib.Path(args.config).resolve()
    summary: dict = {"config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT)
                     else str(config), "seeds": seeds,
                     "max_tokens": sim.build_workload(cfg).max_tokens,
                     "max_tokens_source": sim.max_tokens_source(cfg),
                     "chunk_size": int(cfg.controller.chunk_size)}
    for p in pols:
        tps = [per_seed[s][p]["tokens_per_s"] for s in seeds]
        summary[f"{p}_tokens_per_s_mean"] = sum(tps) / len(tps)
        summary[f"{p}_idle_fraction_mean"] = (
            sum(per_seed[s][p]["idle_fraction"] for s in seeds) / len(seeds))
        if "seer" in pols and p != "seer":
            ratios = [per_seed[s]["seer"]["tokens_per_s"] / per_seed[s][p]["tokens_per_s"]
                      for s in seeds]
            summary[f"seer_tokens_per_s_ratio_vs_{p}"] = {
                "mean": sum(ratios) / len(ratios), "min": min(ratios), "max": max(ratios),
                "per_seed": dict(zip(map(str, seeds), ratios, strict=True))}
    out: dict = {"provenance": prov, "per_seed": per_seed}
    if not args.no_ablation:
        runs = sim.ablation(cfg)
        abl = sim.summarize(runs)
        summary["ablation"] = {k: {m: v[m] for m in (
            "tokens_per_s", "makespan_s", "tail_s", "idle_fraction",
            "tokens_per_s_ratio_vs_group_round_robin", "tail_reduction_vs_group_round_robin")}
            for k, v in abl.items()}
        summary["ablation_seed"] = int(cfg.seed)
        for k, v in abl.items():
            print(f"ablation {k:28s} {v['tokens_per_s']:10,.0f} tok/s "
                  f"{v['tokens_per_s_ratio_vs_group_round_robin']:.2f}x grr")
        out["ablation"] = abl
    out["summary"] = summary
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=float))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
