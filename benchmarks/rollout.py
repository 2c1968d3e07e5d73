"""Rollout benchmark: SmolLM2 on emulated instances, seer vs group_round_robin vs request_fcfs
vs oracle_lfs on the same prompts and seeds. Prints a table and writes JSON.

    python benchmarks/rollout.py --config configs/rollout/bench_structured.py --json out.json \
        [--config.num_prompts=16 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="configs/rollout/bench_structured.py")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--tokens-out", dest="tokens_out", default=None,
                   help="write every policy's response token ids here (JSONL, one line per "
                        "policy and response)")
    args, overrides = p.parse_known_args(argv)
    from seer_jax.analysis.policies import CATALOG
    from seer_jax.analysis.token_diffs import token_differences
    from seer_jax.config_files import load_config_file
    from seer_jax.provenance import run_info
    from seer_jax.rollout.api import run_rollout

    cfg = load_config_file(args.config, overrides)
    t0 = time.perf_counter()
    result = run_rollout(cfg, catalog=CATALOG)  # the oracles compared against live in analysis
    wall = time.perf_counter() - t0
    from rich.console import Console

    from seer_jax.rollout.core.report import print_comparison

    reports = {pol: o.report for pol, o in result.outputs.items()}
    print_comparison(reports, result.summary["baseline"], Console())
    summary = dict(result.summary["policies"])
    if "oracle_lfs" in summary and "seer" in summary:
        summary["seer_fraction_of_oracle_tokens_per_s"] = (
            summary["seer"]["tokens_per_s"] / summary["oracle_lfs"]["tokens_per_s"])
    first = next(iter(reports.values()))
    summary["length_icc"] = first.length_icc
    summary["top10_token_share"] = first.top10_token_share
    diffs = token_differences({pol: o.results for pol, o in result.outputs.items()})
    summary["tokens_identical_across_policies"] = not diffs
    summary["token_differences"] = diffs
    if args.tokens_out:
        with open(args.tokens_out, "w") as f:
            for pol, o in result.outputs.items():
                for r in o.results:
                    f.write(json.dumps({"policy": pol, "request_id": r.request_id,
                                        "finish_reason": str(r.finish_reason),
                                        "token_ids": list(r.token_ids),
                                        "logprobs": list(r.logprobs)}) + "\n")
    report = {"summary": summary, "config": cfg.to_dict(), "benchmark_wall_s": wall,
              "reports": {pol: r.to_json() for pol, r in reports.items()}}
    print(json.dumps(summary, indent=1, default=str))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({**report, "run": run_info()}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
