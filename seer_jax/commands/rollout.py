"""`seer-jax rollout`: a grouped rollout on real engines over mesh slices."""

from __future__ import annotations

import argparse
import json

NAME = "rollout"
HELP = "Run a grouped rollout (G samples per prompt) through the controller on real engines."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="config file, e.g. configs/rollout/demo.py")
    p.add_argument("--compare", default=None, help="comma-separated policies (sets config.policies), e.g. seer,group_round_robin")
    p.add_argument("--json", dest="json_path", default=None, help="write the report JSON here")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the rollout journaled in DIR (config.journal_dir of a run that "
                        "stopped): finished responses are kept, unfinished ones continue")
    p.add_argument("--no-progress", action="store_true")


def time_model_line(cfg) -> str:
    """One line saying what the reported seconds are."""
    if cfg.time_model == "roofline":
        return (f"emulated: each step of the real engines is timed by a roofline of "
                f"{cfg.cost_model} on {cfg.chips_per_instance} x {cfg.accelerator} per slice "
                f"({cfg.num_instances} slices, KV budget {cfg.engine.kv_memory_gib} GiB each)")
    return (f"measured: each step's wall time on this host ({cfg.num_instances} slices, clock "
            f"{cfg.clock})")


def _response_json(r) -> dict:
    out = {"request_id": r.request_id, "token_ids": r.token_ids, "text": r.text,
           "finish_reason": r.finish_reason, "logprobs": r.logprobs}
    if r.routed_experts is not None:  # config.engine.return_routed_experts: [token][layer][k]
        out["routed_experts"] = r.routed_experts
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from seer_jax.analysis.policies import CATALOG
    from seer_jax.config_files import load_config_file
    from seer_jax.provenance import run_info
    from seer_jax.rollout.api import run_rollout
    from seer_jax.rollout.config import validate_config

    cfg = load_config_file(args.config, args.config_overrides)
    if args.compare:
        cfg.policies = args.compare
    validate_config(cfg, CATALOG)
    console = Console(stderr=True)
    progress = None
    bar = None
    if not args.no_progress:
        bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                       TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), console=console)

        def progress(policy):
            task = bar.add_task(f"rollout [{policy}]", total=cfg.num_prompts * cfg.group_size, tps="-")

            def update(done, total, tokens, now):
                bar.update(task, completed=done, tps=f"{tokens / now:.1f}" if now > 0 else "-")
            return update
        bar.start()
    try:
        result = run_rollout(cfg, progress, CATALOG, resume=args.resume)
    finally:
        if bar is not None:
            bar.stop()
    from seer_jax.rollout.core.report import print_comparison, print_report, wide_console

    out = wide_console()
    out.print(f"[bold]time model[/bold]: {time_model_line(cfg)}")
    for policy, o in result.outputs.items():
        out.rule(f"policy: {policy}")
        print_report(o.report, out)
    if len(result.outputs) > 1:
        print_comparison({p: o.report for p, o in result.outputs.items()}, result.summary["baseline"], out)
    first = next(iter(result.outputs.values()))
    sample = first.results[0]
    out.print(f"[bold]sample response[/bold] ({sample.request_id}): {sample.text[:300]!r}")
    if args.json_path:
        report = {
            "summary": result.summary,
            "config": cfg.to_dict(),
            "reports": {p: o.report.to_json() if hasattr(o.report, "to_json") else None
                        for p, o in result.outputs.items()},
            "responses": [_response_json(r) for r in first.results],
            "run": run_info(),
        }
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0
