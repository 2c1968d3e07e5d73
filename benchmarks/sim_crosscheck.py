"""Simulator cross-check: does the cluster simulator predict a real emulated rollout?

1. Run the rollout on real SmolLM2 engines (emulated cluster: N engines on this host, each with
   its own clock) for every policy on the same prompts and seeds; keep its length trace and
   every executed engine step.
2. Calibrate the simulator from that run: a step profile fitted to the executed steps
   (`StepProfile.from_steps`; `--config.time_model=roofline` runs use the same roofline instead)
   and the engines' KV capacity, chunk size, batch limits.
3. Replay the trace in the simulator (same controller and policy code, simulated instances) and
   compare tokens/s and makespan per policy with the emulated run.

    python benchmarks/sim_crosscheck.py --workdir DIR --json out.json [--config.num_prompts=8 ...]
    python benchmarks/sim_crosscheck.py --replay DIR    # re-predict a saved run, no engines

Defaults: a smaller cut of the README's KV-bound structured benchmark (4 prompts x G=8, 128
tokens, chunk 32, ~700 KV tokens per instance, 4 instances), timed by measured step durations
(about 9 minutes on 2 quiet CPU cores; measured times need a quiet machine). The JSON
`summary` has per policy `emulated` / `predicted` tokens/s and makespan, their relative errors,
and `max_abs_error` over all of them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_OVERRIDES = [
    "--config.num_prompts=4", "--config.max_tokens=128", "--config.chunk_size=32",
    "--config.engine.kv_memory_gib=0.03", "--config.engine.max_num_seqs=16",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/rollout/bench_structured.py")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--workdir", default=None, help="keep the trace and fitted profile here")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--replay", default=None,
                    help="re-predict the run saved in this --workdir (no engines are run)")
    args, overrides = ap.parse_known_args(argv)
    from seer_jax.analysis import crosscheck  # noqa: E402
    from seer_jax.analysis.policies import CATALOG  # noqa: E402
    from seer_jax.config_files import load_config_file
    from seer_jax.costs import StepProfile
    from seer_jax.rollout.api import run_rollout
    from seer_jax.sim import simulator as sim

    if args.replay:
        # re-predict a saved run (its trace, fitted profile and emulated results) with the
        # current simulator, without running the engines again
        work = pathlib.Path(args.replay)
        saved, sim_cfg = crosscheck.load_recorded_run(work)
        emulated = saved["emulated"]
        time_model, num_responses, emu_wall = saved["time_model"], saved["num_responses"], None
        baseline, cfg_dict = saved["baseline"], saved["config"]
    else:
        given = {o.split("=")[0] for o in overrides}
        cfg = load_config_file(args.config, [o for o in DEFAULT_OVERRIDES
                                             if o.split("=")[0] not in given] + overrides)
        work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="seer_crosscheck_"))
        work.mkdir(parents=True, exist_ok=True)
        cfg.trace_out = str(work / "trace.jsonl")
        t0 = time.perf_counter()
        run = run_rollout(cfg)
        emu_wall = time.perf_counter() - t0
        (work / "steps.json").write_text(json.dumps(run.step_logs))
        profile_path = None
        if cfg.time_model == "measured":
            steps = [row for rows in run.step_logs.values() for row in rows]
            prof = StepProfile.from_steps(steps, model=cfg.model, device="this host (emulated run)",
                                          page_size=cfg.engine.page_size)
            profile_path = str(work / "profile.json")
            prof.save(profile_path)
        sim_cfg = crosscheck.calibrated_config(
            cfg.trace_out, profile_path, num_instances=cfg.num_instances,
            kv_capacity_tokens=run.kv_capacity_tokens, chunk_size=cfg.chunk_size,
            model=cfg.cost_model, page_size=cfg.engine.page_size,
            max_batch_size=cfg.engine.max_num_seqs,
            max_prefill_tokens=cfg.engine.max_num_batched_tokens,
            balance_threshold=cfg.balance_threshold, max_tokens=cfg.max_tokens,
            accelerator=cfg.accelerator, chips_per_instance=cfg.chips_per_instance)
        sim_cfg.controller.seer_estimator = cfg.seer_estimator
        sim_cfg.controller.seer_quantile = cfg.seer_quantile
        emulated = {pol: {"tokens_per_s": o.report.tokens_per_s, "makespan_s": o.report.makespan_s,
                          "tail_s": o.report.tail_s} for pol, o in run.outputs.items()}
        time_model, num_responses = cfg.time_model, run.summary["num_responses"]
        baseline, cfg_dict = run.summary["baseline"], cfg.to_dict()
        (work / "run.json").write_text(json.dumps(
            {"emulated": emulated, "sim_config": sim_cfg.to_dict(), "time_model": time_model,
             "num_responses": num_responses, "baseline": baseline, "config": cfg_dict},
            indent=1, default=str))
    policies = list(emulated)
    t1 = time.perf_counter()
    pred = sim.summarize(sim.compare(sim_cfg, policies, catalog=CATALOG), baseline=baseline)
    sim_wall = time.perf_counter() - t1

    summary: dict = {"time_model": time_model, "policies": {}}
    errors = []
    print(f"\n{'policy':18s} {'emu tok/s':>10s} {'sim tok/s':>10s} {'err':>7s} "
          f"{'emu makespan':>12s} {'sim makespan':>12s} {'err':>7s}")
    for pol in policies:
        emu = emulated[pol]
        p = pred[pol]
        e_tps = p["tokens_per_s"] / emu["tokens_per_s"] - 1.0
        e_mk = p["makespan_s"] / emu["makespan_s"] - 1.0
        errors += [e_tps, e_mk]
        summary["policies"][pol] = {
            "emulated": emu,
            "predicted": {"tokens_per_s": p["tokens_per_s"], "makespan_s": p["makespan_s"],
                          "tail_s": p["tail_s"]},
            "tokens_per_s_rel_error": e_tps,
            "makespan_rel_error": e_mk,
        }
        print(f"{pol:18s} {emu['tokens_per_s']:10,.1f} {p['tokens_per_s']:10,.1f} {e_tps:+7.1%} "
              f"{emu['makespan_s']:12.3f} {p['makespan_s']:12.3f} {e_mk:+7.1%}")
    summary["max_abs_error"] = max(abs(e) for e in errors)
    summary["within_tolerance"] = summary["max_abs_error"] <= args.tolerance
    summary["tolerance"] = args.tolerance
    summary["num_responses"] = num_responses
    summary["emulated_wall_s"] = emu_wall
    summary["simulator_wall_s"] = sim_wall
    emu_txt = f"emulated run {emu_wall:.0f} s, " if emu_wall is not None else "replayed, "
    print(f"max |error| {summary['max_abs_error']:.1%} (tolerance {args.tolerance:.0%}); "
          f"{emu_txt}simulator {sim_wall:.1f} s; files in {work}")
    if args.json_path:
        pathlib.Path(args.json_path).write_text(json.dumps(
            {"summary": summary, "config": cfg_dict, "calibrated_sim_config": sim_cfg.to_dict()},
            indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
