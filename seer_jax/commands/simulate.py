"""`seer-jax simulate`: the real controller and policies on simulated instances at pod scale.

    seer-jax simulate --config configs/sim/moonlight.py [--config.key=value ...]
        [--compare seer,group_round_robin,...] [--ablation] [--sweep] [--plots DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from seer_jax.config_files import load_config_file
from seer_jax.errors import ConfigError

NAME = "simulate"
HELP = ("simulate a rollout iteration on a cluster (cost model + the real controller): compare "
        "policies, the Seer ablation, or sweep length correlation and tail heaviness")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="a configs/sim/*.py file (get_config())")
    p.add_argument("--compare", default="",
                   help="comma-separated policies (default: config.policies)")
    p.add_argument("--ablation", action="store_true",
                   help="divided only -> + context scheduling -> + grouped speculative decoding")
    p.add_argument("--sweep", action="store_true",
                   help="seer's gain vs ICC (0..0.9) and tail heaviness (config.sweep)")
    p.add_argument("--plots", default="", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--json", default="", metavar="PATH", help="write results as JSON")


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _table(summary: dict, baseline: str, title: str):
    from rich.table import Table

    t = Table(title=title)
    cols = ["run", "tokens/s", "makespan s", "tail s", "p50 s", "p90 s", "p99 s", "idle",
            "preempt", f"tok/s vs {baseline}", "tail reduction"]
    for c in cols:
        t.add_column(c, justify="left" if c == "run" else "right")
    for name, r in summary.items():
        t.add_row(
            name, f"{r['tokens_per_s']:,.0f}", f"{r['makespan_s']:,.1f}", f"{r['tail_s']:,.1f}",
            f"{r['latency_p50_s']:,.1f}", f"{r['latency_p90_s']:,.1f}",
            f"{r['latency_p99_s']:,.1f}", f"{r['idle_fraction']:.0%}", str(r["preemptions"]),
            _fmt(r.get(f"tokens_per_s_ratio_vs_{baseline}"), ".2f") + "x",
            _fmt(r.get(f"tail_reduction_vs_{baseline}"), ".0%"),
        )
    return t


def run(args: argparse.Namespace) -> int:

    from seer_jax.analysis.policies import CATALOG
    from seer_jax.sim import simulator as sim

    cfg = load_config_file(args.config, getattr(args, "config_overrides", []))
    if args.compare:
        cfg.policies = args.compare
    sim.validate_config(cfg, CATALOG)
    from seer_jax.rollout.core.report import wide_console

    console = wide_console()
    work = sim.build_workload(cfg)
    cost = sim.build_cost_model(cfg)
    st = work.stats()
    console.print(
        f"[bold]{cfg.name}[/bold]: {st['num_groups']} prompts x {st['num_responses'] // st['num_groups']}"
        f" = {st['num_responses']} responses, max_tokens {st['max_tokens']:,} (from "
        f"{sim.max_tokens_source(cfg)}), "
        f"{st['total_output_tokens']:,} output tokens, ICC(log) {st['length_icc_log']:.2f}, "
        f"longest 10% hold {st['longest_10pct_token_share']:.0%} of tokens; "
        f"{cfg.cluster.num_instances} instances, KV {sim.kv_capacity_pages(cfg, cost) * cfg.cluster.page_size:,}"
        " tokens each"
    )
    st["max_tokens_source"] = sim.max_tokens_source(cfg)
    out: dict = {"config": cfg.to_dict(), "workload": st, "cost_model": cost.describe()}
    baseline = cfg.baseline
    summary: dict = {}

    runs = sim.compare(cfg, sim.policy_list(cfg.policies, CATALOG), workload=work, catalog=CATALOG)
    comp = sim.summarize(runs, baseline)
    console.print(_table(comp, baseline, f"{cfg.name}: policies vs {baseline}"))
    summary["policies"] = comp
    out["compare"] = comp
    if "seer" in comp and "oracle_lfs" in comp:
        summary["seer_tokens_per_s_ratio_vs_oracle_lfs"] = (
            comp["seer"]["tokens_per_s"] / comp["oracle_lfs"]["tokens_per_s"])
    all_runs = dict(runs)

    if args.ablation:
        abl = sim.ablation(cfg, workload=work, include_baseline=baseline not in runs)
        if baseline in runs:
            abl = {baseline: runs[baseline], **abl}
        abl_sum = sim.summarize(abl, baseline)
        console.print(_table(abl_sum, baseline, f"{cfg.name}: ablation"))
        ladder = [label for label, _, _ in sim.ABLATION_STEPS]
        tps = [abl_sum[label]["tokens_per_s"] for label in ladder]
        summary["ablation"] = {label: abl_sum[label] for label in ladder}
        summary["ablation_order_ok"] = all(a < b for a, b in zip(tps, tps[1:], strict=False))
        out["ablation"] = abl_sum
        all_runs.update({k: v for k, v in abl.items() if k not in all_runs})

    if args.sweep:
        def show(cell):
            console.print(
                f"  icc={cell['icc_target']:.2f} sigma={cell['sigma']:.2f}: seer/grr "
                f"{cell.get('seer_tokens_per_s_ratio_vs_group_round_robin', float('nan')):.2f}x, "
                f"seer/fcfs {cell.get('seer_tokens_per_s_ratio_vs_request_fcfs', float('nan')):.2f}x"
            )

        console.print(f"sweep: {len(cfg.sweep.iccs)} ICCs x {len(cfg.sweep.sigmas)} tail sigmas")
        sw = sim.sweep(cfg, progress=show, catalog=CATALOG)
        out["sweep"] = sw
        summary["sweep_gain"] = sw["gain"]
        if "reference" in sw:
            summary["sweep_reference"] = sw["reference"]
            console.print(f"reference trace {sw['reference']['trace']}: ICC "
                          f"{sw['reference']['icc']:.2f}, sigma {sw['reference']['sigma']:.2f}")
        if args.plots:
            import numpy as np

            from seer_jax.sim import plots

            p = plots.plot_sweep(sw["iccs"], sw["sigmas"],
                                 {k: np.asarray(v) for k, v in sw["gain"].items()},
                                 pathlib.Path(args.plots) / "sweep.png",
                                 title=f"{cfg.name}: seer's throughput gain",
                                 reference=sw.get("reference"))
            console.print(f"wrote {p}")

    if args.plots:
        paths = sim.write_plots(all_runs, args.plots, title=cfg.name)
        if args.ablation:
            from seer_jax.sim import plots

            paths.append(plots.plot_bars(
                {k: v["tokens_per_s"] for k, v in out["ablation"].items()},
                pathlib.Path(args.plots) / "ablation.png", ylabel="output tokens/s",
                title=f"{cfg.name}: ablation"))
        console.print(f"wrote {len(paths)} plots to {args.plots}")

    if args.json:
        from seer_jax.provenance import run_info

        out["summary"] = summary
        out["run"] = run_info()
        path = pathlib.Path(args.json)
        if path.parent and not path.parent.exists():
            raise ConfigError(f"--json directory does not exist: {path.parent}")
        path.write_text(json.dumps(out, indent=1, default=float))
        console.print(f"wrote {path}")
    return 0
