"""No regret from context: `seer`'s makespan against `request_fcfs`'s on every shipped simulator
preset (configs/sim/*.py) and on both halves of the real reasoning trace, over several workload
seeds.

    .venv/bin/python benchmarks/no_regret.py [--seeds 0,1,2,3] [--presets small,moonlight,...]
        [--policies seer,request_fcfs] [--jobs N] [--json benchmarks/results/no_regret.json]
        [--config.key=value ...]

`--jobs`: run (workload, seed) cells in N processes (the results do not depend on it).

Trace halves: benchmarks/data/r1_aime_lengths.jsonl's problems, in file order, split into a
first and a second half (186 problems each); each half is resampled to the r1_aime preset's 400
groups per seed and run at that preset's cluster shape, so a rule tuned on the whole trace is
also checked on problems it may not have been tuned on.

Prints one row per (workload, seed) and writes JSON with the exact command and commit (`run`)
and a top-level `summary`: per workload the mean and worst (largest) makespan ratio
seer / request_fcfs over the seeds, and `no_regret` (true when seer's makespan is no longer than
request_fcfs's on every workload and seed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from seer_jax.analysis.policies import CATALOG  # noqa: E402
from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402
from seer_jax.sim import simulator as sim  # noqa: E402
from seer_jax.sim import workloads as wl  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRESETS = ("small", "qwen2_vl_72b", "moonlight", "r1_aime", "kimi_k2")
TRACE_HALVES = ("r1_aime_half1", "r1_aime_half2")
TOL = 1e-9  # makespans are equal when they differ by less (floating-point sums)


def trace_half(work: wl.Workload, half: int) -> wl.Workload:
    """The first (`half`=0) or second (1) half of `work`'s groups, in trace order."""
    groups = work.groups()
    cut = len(groups) // 2
    keep = groups[:cut] if half == 0 else groups[cut:]
    flat = np.concatenate(keep)
    return wl.Workload(
        name=f"{work.name}_half{half + 1}",
        group_ids=[work.group_ids[int(work.group_index[ix[0]])] for ix in keep],
        group_index=np.concatenate([np.full(len(ix), i, dtype=np.int64)
                                    for i, ix in enumerate(keep)]),
        prompt_len=work.prompt_len[flat],
        output_len=work.output_len[flat],
        max_tokens=work.max_tokens,
    )


def workload_for(name: str, overrides: list[str], seed: int):
    """(config, workload) of a preset or a trace half for one seed."""
    preset = "r1_aime" if name in TRACE_HALVES else name
    cfg = load_config_file(str(ROOT / f"configs/sim/{preset}.py"), overrides)
    sim.validate_config(cfg, CATALOG)
    if name in TRACE_HALVES:
        full = wl.load_trace(cfg.workload.trace_path)
        half = trace_half(full, TRACE_HALVES.index(name))
        return cfg, wl.scale_workload(half, int(cfg.workload.trace_num_groups), seed=seed)
    return cfg, sim.build_workload(cfg, seed=seed)


COST = {"kimi_k2": 6, "moonlight": 5, "r1_aime": 3, "r1_aime_half1": 3, "r1_aime_half2": 3,
        "qwen2_vl_72b": 2}  # relative run time, for scheduling


def run_cell(cell) -> tuple[dict, float]:
    """Makespan per policy of one (workload, seed), and the wall seconds it took."""
    name, seed, overrides, pols = cell
    cfg, work = workload_for(name, overrides, seed)
    t = time.perf_counter()
    ms = {p: sim.simulate(cfg, p, workload=work, catalog=CATALOG).report.makespan_s for p in pols}
    return ms, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--presets", default=",".join(PRESETS + TRACE_HALVES))
    ap.add_argument("--policies", default="seer,request_fcfs")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", default="benchmarks/results/no_regret.json")
    args, overrides = ap.parse_known_args()
    run = run_info()  # the code that runs, before anything can change the tree
    seeds = [int(s) for s in args.seeds.split(",")]
    pols = sim.policy_list(args.policies, CATALOG)
    if "seer" not in pols or "request_fcfs" not in pols:
        ap.error("--policies must include seer and request_fcfs")
    names = [n for n in args.presets.split(",") if n]
    for n in names:
        if n not in PRESETS + TRACE_HALVES:
            ap.error(f"unknown preset {n!r}; allowed: {', '.join(PRESETS + TRACE_HALVES)}")
    # the slowest presets first, so N processes finish together
    order = sorted(names, key=lambda n: -COST.get(n, 1))
    cells = [(n, sd, overrides, pols) for n in order for sd in seeds]
    print(f"{'workload':14s} {'seed':>4s} " + " ".join(f"{p:>14s}" for p in pols)
          + f" {'seer/fcfs':>9s}")
    rows: dict[str, dict] = {n: {} for n in names}
    with concurrent.futures.ProcessPoolExecutor(max(1, args.jobs)) as ex:
        futures = {ex.submit(run_cell, c): c for c in cells}
        for fut in concurrent.futures.as_completed(futures):
            n, sd, _, _ = futures[fut]
            ms, wall = fut.result()
            ratio = ms["seer"] / ms["request_fcfs"]
            rows[n][str(sd)] = {"makespan_s": ms, "seer_over_request_fcfs": ratio}
            print(f"{n:14s} {sd:4d} " + " ".join(f"{ms[p]:13.1f}s" for p in pols)
                  + f" {ratio:9.4f}  ({wall:.0f} s)", flush=True)
    rows = {n: {str(s): rows[n][str(s)] for s in seeds} for n in names}
    summary: dict = {"seeds": seeds, "policies": pols, "workloads": {}}
    for n in names:
        ratios = [rows[n][str(s)]["seer_over_request_fcfs"] for s in seeds]
        summary["workloads"][n] = {
            "makespan_ratio_seer_over_request_fcfs_mean": sum(ratios) / len(ratios),
            "makespan_ratio_seer_over_request_fcfs_max": max(ratios),
            **{f"{p}_makespan_s_mean": sum(rows[n][str(s)]["makespan_s"][p] for s in seeds)
               / len(seeds) for p in pols},
            "no_regret": all(r <= 1.0 + TOL for r in ratios),
        }
    summary["no_regret"] = all(w["no_regret"] for w in summary["workloads"].values())
    print(f"no regret on every workload and seed: {summary['no_regret']}")
    out = {"run": run, "summary": summary, "per_seed": rows}
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
