"""How much can group context buy? seer against a scheduler that knows every group's longest
response (`oracle_group_lfs`), in the simulator.

`oracle_group_lfs` orders requests by their group's *true* longest length minus what they have
generated: what a perfect group-context length estimator would give seer's LFS rule. It cannot
tell which sibling is the long one. So on one workload:

- request_fcfs -> oracle_group_lfs: the most that context-aware scheduling from group lengths
  can gain over divided rollout without context;
- oracle_group_lfs -> oracle_lfs: what only per-request knowledge buys (no group estimator can);
- `group_context_captured` = (seer - request_fcfs) / (oracle_group_lfs - request_fcfs): the share
  of the available group-context gain seer's online estimator realizes (tokens/s);
- `seer_running_oracle` is seer with exact group maxima for started requests only (fresh ones
  keep seer's estimate): `running_decision_share` = (seer_running_oracle - request_fcfs) /
  (oracle_group_lfs - request_fcfs) is the share of that gain that lies in ranking the requests
  already under way.
- `seer_prompt_oracle` (Moonlight only: it needs the synthetic workload's generating
  distributions) is seer with a perfect length model: each request ranked by the quantile of its
  remaining length under the distribution its prompt's lengths were drawn from. No group-context
  estimator can know more, so `seer_prompt_oracle_vs_oracle_lfs` is what seer's rule reaches
  with perfect knowledge of the prompts (not a strict ceiling: a more hedged estimate can
  schedule better), and `seer_vs_seer_prompt_oracle` compares seer's online fit with it.

Workloads: the length traces of the issue-scale engine rollouts (`benchmarks/rollout.py`, both
prompt mixes, replayed on simulated instances calibrated like those runs: same instance count,
batch and KV limits, chunk size, H100 roofline, read from the runs' reports; the cross-check puts the simulator within ~2% of
such runs), and the Moonlight-shaped preset over `--seeds` workload draws, at its length ICC
(0.6) and at each `--extra-icc`.

    .venv/bin/python benchmarks/context_ceiling.py [--json out.json] [--seeds 0,1,2,3]
        [--extra-icc 0.9] [--skip-moonlight]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import ml_collections

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from seer_jax.analysis import crosscheck  # noqa: E402
from seer_jax.analysis.policies import CATALOG  # noqa: E402
from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.costs import get_model  # noqa: E402
from seer_jax.engine.engine import EngineConfig  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402
from seer_jax.sim import simulator as sim  # noqa: E402

POLICIES = ["group_round_robin", "request_fcfs", "seer", "seer_running_oracle", "oracle_group_lfs",
            "oracle_lfs"]
MOONLIGHT_POLICIES = POLICIES + ["seer_prompt_oracle"]
RESULTS = ROOT / "benchmarks" / "results" / "rollout_engines"
# mix -> (length trace, the report whose config the engines ran with)
TRACES = {
    "structured": (RESULTS / "structured_trace.jsonl", RESULTS / "structured_fcfs_seer_oracle.json"),
    "natural": (RESULTS / "natural_trace.jsonl", RESULTS / "natural.json"),
}


def kv_capacity_tokens(rollout_cfg) -> int:
    """KV tokens per instance of the engines a rollout config builds (`EngineConfig.kv_pages`,
    with the KV bytes per token of the config's model and dtype, as `ModelConfig` counts them)."""
    e = EngineConfig(**rollout_cfg.engine.to_dict())
    m = get_model(rollout_cfg.cost_model)
    itemsize = 4 if rollout_cfg.dtype == "float32" else 2
    return e.kv_pages(m.num_layers * m.kv_elems_per_layer * itemsize) * e.page_size


def trace_config(trace: pathlib.Path, rollout_cfg):
    c = rollout_cfg
    cfg = crosscheck.calibrated_config(
        str(trace), None, num_instances=c.num_instances, kv_capacity_tokens=kv_capacity_tokens(c),
        chunk_size=c.chunk_size, model=c.cost_model, page_size=c.engine.page_size,
        max_batch_size=c.engine.max_num_seqs, max_prefill_tokens=c.engine.max_num_batched_tokens,
        balance_threshold=c.balance_threshold, max_tokens=c.max_tokens, accelerator=c.accelerator,
        chips_per_instance=c.chips_per_instance)
    cfg.controller.seer_estimator = c.seer_estimator
    cfg.controller.seer_quantile = c.seer_quantile
    return cfg


def ceiling(summ: dict) -> dict:
    fcfs, seer = summ["request_fcfs"]["tokens_per_s"], summ["seer"]["tokens_per_s"]
    group, oracle = summ["oracle_group_lfs"]["tokens_per_s"], summ["oracle_lfs"]["tokens_per_s"]
    running = summ["seer_running_oracle"]["tokens_per_s"]

    def share(x: float) -> float | None:  # of the gain oracle_group_lfs has over fcfs
        return (x - fcfs) / (group - fcfs) if group > fcfs else None

    prompt = {}
    if "seer_prompt_oracle" in summ:
        po = summ["seer_prompt_oracle"]["tokens_per_s"]
        prompt = {"seer_prompt_oracle_vs_request_fcfs": po / fcfs,
                  "seer_prompt_oracle_vs_oracle_lfs": po / oracle,
                  "seer_vs_seer_prompt_oracle": seer / po}
    return {
        "seer_vs_request_fcfs": seer / fcfs,
        "seer_vs_oracle_lfs": seer / oracle,
        "oracle_group_lfs_vs_request_fcfs": group / fcfs,
        "oracle_lfs_vs_request_fcfs": oracle / fcfs,
        "seer_vs_oracle_group_lfs": seer / group,
        "oracle_group_lfs_vs_oracle_lfs": group / oracle,
        "group_context_captured": share(seer),
        "seer_running_oracle_vs_request_fcfs": running / fcfs,
        "running_decision_share": share(running),
        **{f"{p}_tokens_per_s_ratio_vs_group_round_robin":
           summ[p]["tokens_per_s_ratio_vs_group_round_robin"] for p in summ},
        **prompt,
    }


def runs_row(summ: dict) -> dict:
    return {p: {k: summ[p][k] for k in ("tokens_per_s", "makespan_s", "tail_s")} for p in summ}


def fmt(share: float | None) -> str:
    return "n/a" if share is None else f"{share:.0%}"


def print_table(title: str, summ: dict, ceil: dict) -> None:
    print(f"\n{title}")
    print(f"{'policy':20s} {'tokens/s':>10s} {'makespan':>9s} {'tail':>8s} {'vs grr':>7s} "
          f"{'vs fcfs':>8s}")
    fcfs = summ["request_fcfs"]["tokens_per_s"]
    for p, r in summ.items():
        print(f"{p:20s} {r['tokens_per_s']:10,.0f} {r['makespan_s']:9,.3f} {r['tail_s']:8,.3f} "
              f"{r['tokens_per_s_ratio_vs_group_round_robin']:6.3f}x "
              f"{r['tokens_per_s'] / fcfs:7.3f}x")
    cap = ceil["group_context_captured"]
    print(f"group context available over fcfs: {ceil['oracle_group_lfs_vs_request_fcfs'] - 1:+.1%}; "
          f"seer realizes {fmt(cap)} of it "
          f"(seer / oracle_group_lfs {ceil['seer_vs_oracle_group_lfs']:.3f}); "
          f"ranking started requests holds {fmt(ceil['running_decision_share'])} of it")
    if "seer_prompt_oracle_vs_oracle_lfs" in ceil:
        print(f"with a perfect length model seer's rule reaches "
              f"{ceil['seer_prompt_oracle_vs_oracle_lfs']:.3f} of oracle_lfs "
              f"({ceil['seer_prompt_oracle_vs_request_fcfs']:.3f}x fcfs); seer "
              f"{ceil['seer_vs_oracle_lfs']:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--seeds", default="0", help="Moonlight workload draws, comma-separated")
    ap.add_argument("--extra-icc", default="0.9",
                    help="also run Moonlight at these length ICCs, comma-separated ('' for none)")
    ap.add_argument("--skip-moonlight", action="store_true")
    args = ap.parse_args(argv)
    out: dict = {"summary": {}, "runs": {}}
    for mix, (trace, report) in TRACES.items():
        rollout_cfg = ml_collections.ConfigDict(json.loads(report.read_text())["config"])
        t0 = time.perf_counter()
        summ = sim.summarize(sim.compare(trace_config(trace, rollout_cfg), POLICIES, catalog=CATALOG))
        ceil = ceiling(summ)
        print_table(f"{mix} (engine trace {trace.name}, replayed; {time.perf_counter() - t0:.0f} s)",
                    summ, ceil)
        out["summary"][mix] = ceil
        out["runs"][mix] = runs_row(summ)
    if not args.skip_moonlight:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        iccs = [None] + [float(x) for x in args.extra_icc.split(",") if x.strip()]
        for icc in iccs:
            key = "moonlight" if icc is None else f"moonlight_icc{icc:g}"
            per_seed = []
            for seed in seeds:
                over = [f"--config.seed={seed}"]
                if icc is not None:
                    over.append(f"--config.workload.icc={icc}")
                cfg = load_config_file(str(ROOT / "configs" / "sim" / "moonlight.py"), over)
                t0 = time.perf_counter()
                summ = sim.summarize(sim.compare(cfg, MOONLIGHT_POLICIES, catalog=CATALOG))
                ceil = ceiling(summ)
                print_table(f"moonlight preset, ICC {cfg.workload.icc:g}, seed {seed} "
                            f"({time.perf_counter() - t0:.0f} s)", summ, ceil)
                per_seed.append(ceil)
                out["runs"][f"{key}_seed{seed}"] = runs_row(summ)
            keys = [k for k in per_seed[0] if all(c[k] is not None for c in per_seed)]
            out["summary"][key] = {
                "icc": cfg.workload.icc,
                "seeds": seeds,
                "mean": {k: sum(c[k] for c in per_seed) / len(per_seed) for k in keys},
                "per_seed": per_seed,
            }
            m = out["summary"][key]["mean"]
            print(f"\n{key}, mean over seeds {seeds}: seer / fcfs {m['seer_vs_request_fcfs']:.3f}, "
                  f"oracle_group_lfs / fcfs {m['oracle_group_lfs_vs_request_fcfs']:.3f}, "
                  f"oracle_group_lfs / oracle_lfs {m['oracle_group_lfs_vs_oracle_lfs']:.3f}, "
                  f"seer_running_oracle / fcfs {m['seer_running_oracle_vs_request_fcfs']:.3f}, "
                  f"seer_prompt_oracle / oracle_lfs {m['seer_prompt_oracle_vs_oracle_lfs']:.3f} "
                  f"(/ fcfs {m['seer_prompt_oracle_vs_request_fcfs']:.3f}), seer / oracle_lfs "
                  f"{m['seer_vs_oracle_lfs']:.3f}")
    if args.json_path:
        out["run"] = run_info()
        pathlib.Path(args.json_path).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
