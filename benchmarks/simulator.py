"""Simulator benchmark: the Moonlight-shaped table (policies + ablation) and the simulator's own
speed on the Kimi-K2-shaped preset (6,400 responses, 256 instances).

    .venv/bin/python benchmarks/simulator.py [--json out.json] [--skip-kimi] [--kimi-policies seer]
        [--seeds 0,1,2,3] [--icc 0.9] [--config.controller.seer_quantile=0.998 ...]

`--seeds`: the Moonlight table on several workload draws (mean ratios in the summary);
`--icc`: the preset with another intra-group length correlation.

Prints tables and writes JSON with a top-level `summary`:
  moonlight.<run>.{tokens_per_s, makespan_s, tail_s, tokens_per_s_ratio_vs_group_round_robin,
  tail_reduction_vs_group_round_robin}, seer_tokens_per_s_ratio_vs_oracle_lfs, ablation_order_ok,
  kimi_k2_sim_wall_s, kimi_k2_events_per_s.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from seer_jax.analysis.policies import CATALOG  # noqa: E402
from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402
from seer_jax.sim import simulator as sim  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _print_table(title: str, summ: dict) -> None:
    print(f"\n{title}")
    hdr = (f"{'run':30s} {'tokens/s':>10s} {'makespan':>9s} {'tail':>8s} {'p50':>7s} {'p99':>7s} "
           f"{'idle':>5s} {'preempt':>7s} {'tok/s vs grr':>12s} {'tail red.':>9s}")
    print(hdr)
    print("-" * len(hdr))
    for name, r in summ.items():
        ratio = r.get("tokens_per_s_ratio_vs_group_round_robin")
        red = r.get("tail_reduction_vs_group_round_robin")
        print(f"{name:30s} {r['tokens_per_s']:10,.0f} {r['makespan_s']:9,.1f} {r['tail_s']:8,.1f} "
              f"{r['latency_p50_s']:7,.1f} {r['latency_p99_s']:7,.1f} {r['idle_fraction']:5.0%} "
              f"{r['preemptions']:7d} {ratio:11.2f}x {red:9.0%}")


def moonlight_runs(cfg, work) -> dict:
    runs = sim.compare(cfg, ["group_round_robin", "request_fcfs", "seer", "oracle_lfs"],
                       workload=work, catalog=CATALOG)
    runs["seer + grouped SD"] = sim.simulate(cfg, "seer", speculation=True, workload=work,
                                            label="seer + grouped SD", catalog=CATALOG)
    return runs


def headline(summ: dict) -> dict:
    ladder = [summ[k]["tokens_per_s"] for k in ("request_fcfs", "seer", "seer + grouped SD")]
    seer = summ["seer"]
    return {
        "seer_tokens_per_s_ratio_vs_group_round_robin":
            seer["tokens_per_s_ratio_vs_group_round_robin"],
        "seer_tail_reduction_vs_group_round_robin": seer["tail_reduction_vs_group_round_robin"],
        "seer_tokens_per_s_ratio_vs_oracle_lfs":
            seer["tokens_per_s"] / summ["oracle_lfs"]["tokens_per_s"],
        "seer_tokens_per_s_ratio_vs_request_fcfs":
            seer["tokens_per_s"] / summ["request_fcfs"]["tokens_per_s"],
        "ablation_order_ok": all(a < b for a, b in zip(ladder, ladder[1:], strict=False)),
    }


def per_seed(cfg, seeds: list[int]) -> dict:
    """The Moonlight table on several workload draws: per seed headline ratios, and their mean."""
    rows = {}
    for sd in seeds:
        summ = sim.summarize(moonlight_runs(cfg, sim.build_workload(cfg, seed=sd)))
        rows[sd] = headline(summ)
        r = rows[sd]
        print(f"seed {sd}: seer vs grr {r['seer_tokens_per_s_ratio_vs_group_round_robin']:.2f}x, "
              f"tail -{r['seer_tail_reduction_vs_group_round_robin']:.0%}, "
              f"vs oracle {r['seer_tokens_per_s_ratio_vs_oracle_lfs']:.3f}, "
              f"vs fcfs {r['seer_tokens_per_s_ratio_vs_request_fcfs']:.3f}, "
              f"ablation ok {r['ablation_order_ok']}", flush=True)
    keys = [k for k in next(iter(rows.values())) if k != "ablation_order_ok"]
    mean = {k: float(sum(r[k] for r in rows.values()) / len(rows)) for k in keys}
    mean["ablation_order_ok_seeds"] = sum(r["ablation_order_ok"] for r in rows.values())
    print("mean over seeds: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()))
    return {"icc": float(cfg.workload.icc), "per_seed": rows, "mean": mean}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/simulator.json")
    ap.add_argument("--skip-kimi", action="store_true")
    ap.add_argument("--kimi-policies", default="seer")
    ap.add_argument("--plots", default="", help="write Moonlight plots into this directory")
    ap.add_argument("--seeds", default="", help="comma-separated workload seeds (default: the "
                    "config's seed only)")
    ap.add_argument("--icc", type=float, default=None, help="override workload.icc")
    args, overrides = ap.parse_known_args()

    out: dict = {}
    summary: dict = {}
    cfg = load_config_file(ROOT / "configs/sim/moonlight.py", overrides)
    if args.icc is not None:
        cfg.workload.icc = args.icc
    sim.validate_config(cfg, CATALOG)
    if args.seeds:
        seeds = [int(x) for x in args.seeds.split(",")]
        summary["seeds"] = per_seed(cfg, seeds)
    work = sim.build_workload(cfg)
    t0 = time.perf_counter()
    runs = moonlight_runs(cfg, work)
    moon_wall = time.perf_counter() - t0
    summ = sim.summarize(runs)
    _print_table(f"Moonlight-shaped: {work.stats()['num_responses']} responses, "
                 f"{cfg.cluster.num_instances} instances ({moon_wall:.0f} s to simulate)", summ)
    ladder = ["request_fcfs", "seer", "seer + grouped SD"]
    tps = [summ[k]["tokens_per_s"] for k in ladder]
    summary["moonlight"] = {k: {m: v[m] for m in (
        "tokens_per_s", "makespan_s", "tail_s", "tokens_per_s_ratio_vs_group_round_robin",
        "tail_reduction_vs_group_round_robin", "preemptions", "idle_fraction")}
        for k, v in summ.items()}
    summary["seer_tokens_per_s_ratio_vs_oracle_lfs"] = (
        summ["seer"]["tokens_per_s"] / summ["oracle_lfs"]["tokens_per_s"])
    summary["ablation_order_ok"] = all(a < b for a, b in zip(tps, tps[1:], strict=False))
    summary["moonlight_sim_wall_s"] = moon_wall
    out["moonlight"] = {"workload": work.stats(), "runs": summ,
                        "cost_model": sim.build_cost_model(cfg).describe()}
    print(f"seer / oracle_lfs tokens/s: {summary['seer_tokens_per_s_ratio_vs_oracle_lfs']:.3f}; "
          f"ablation order divided < +context < +grouped SD: {summary['ablation_order_ok']}")
    if args.plots:
        sim.write_plots(runs, args.plots, title="moonlight")

    if not args.skip_kimi:
        k2 = load_config_file(ROOT / "configs/sim/kimi_k2.py")
        sim.validate_config(k2, CATALOG)
        kw = sim.build_workload(k2)
        kruns = {}
        for pol in sim.policy_list(args.kimi_policies):
            t = time.perf_counter()
            kruns[pol] = sim.simulate(k2, pol, workload=kw, catalog=CATALOG)
            total = time.perf_counter() - t
            r = kruns[pol]
            print(f"Kimi-K2-shaped ({kw.num_responses} responses, {k2.cluster.num_instances} "
                  f"instances) {pol}: {total:.1f} s wall ({r.wall_s:.1f} s in the driver loop), "
                  f"{r.driver_steps:,} instance steps = {r.events_per_s:,.0f} events/s, "
                  f"{r.iterations:,} simulated decode iterations; "
                  f"tokens/s {r.report.tokens_per_s:,.0f}, makespan {r.report.makespan_s:,.0f} s")
            summary.setdefault("kimi_k2", {})[pol] = {
                "sim_wall_s": total, "events_per_s": r.events_per_s,
                "tokens_per_s": r.report.tokens_per_s, "makespan_s": r.report.makespan_s,
                "tail_s": r.report.tail_s}
        first = next(iter(summary["kimi_k2"].values()))
        summary["kimi_k2_sim_wall_s"] = first["sim_wall_s"]
        summary["kimi_k2_events_per_s"] = first["events_per_s"]
        out["kimi_k2"] = {"workload": kw.stats(), "runs": sim.summarize(kruns)
                          if "group_round_robin" in kruns else
                          {k: v.row() for k, v in kruns.items()}}

    out["summary"] = summary
    path = pathlib.Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    out["run"] = run_info()
    path.write_text(json.dumps(out, indent=1, default=float))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
