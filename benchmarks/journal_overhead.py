"""What the rollout journal costs: the demo rollout (configs/rollout/demo.py) with and without
`journal_dir`, alternating, after one warm-up run; and the time spent inside the journal's
writes (encoding, write, flush) as a share of the journaled rollout's wall time.

    python benchmarks/journal_overhead.py [--reps 2] [--json benchmarks/results/journal_overhead.json]
        [--config configs/rollout/demo.py] [--config.key=value ...]

The wall-time ratio of two runs on a shared machine moves by a few percent from run to run; the
write time is measured directly and is the number the overhead budget (2%) is checked against.
JSON: command, commit, versions (`run`), every run, and a top-level `summary`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/rollout/demo.py"))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", dest="json_path", default="benchmarks/results/journal_overhead.json")
    args, overrides = p.parse_known_args(argv)
    from seer_jax.config_files import load_config_file
    from seer_jax.provenance import run_info
    from seer_jax.rollout.api import run_rollout

    def once(journal: bool, tmp: pathlib.Path):
        cfg = load_config_file(args.config, overrides)
        if journal:
            cfg.journal_dir = str(tmp / f"j{time.perf_counter_ns()}")
        t0 = time.perf_counter()
        run = run_rollout(cfg)
        wall = time.perf_counter() - t0
        tokens = {pol: [r.token_ids for r in o.results] for pol, o in run.outputs.items()}
        row = {"journal": journal, "wall_s": wall, **(run.journal or {})}
        print(json.dumps(row), flush=True)
        return row, tokens

    runs = []
    with tempfile.TemporaryDirectory(prefix="seer_journal_bench_") as tmp:
        _, ref = once(False, pathlib.Path(tmp))  # warm-up: model files in the page cache
        same = True
        for rep in range(args.reps):
            for journal in ((False, True) if rep % 2 == 0 else (True, False)):
                row, tokens = once(journal, pathlib.Path(tmp))
                same &= tokens == ref
                runs.append(row)
    off = [r["wall_s"] for r in runs if not r["journal"]]
    on = [r for r in runs if r["journal"]]
    share = statistics.median(r["write_s"] / r["wall_s"] for r in on)
    summary = {
        "config": args.config, "overrides": overrides, "reps": args.reps,
        "wall_s_without_journal_median": statistics.median(off),
        "wall_s_with_journal_median": statistics.median(r["wall_s"] for r in on),
        "wall_ratio_with_over_without": statistics.median(r["wall_s"] for r in on)
        / statistics.median(off),
        "journal_write_s_median": statistics.median(r["write_s"] for r in on),
        "journal_write_share_of_wall": share,
        "journal_records": on[0]["records"], "journal_bytes": on[0]["bytes"],
        "within_2_percent": share <= 0.02,
        "responses_identical_with_and_without_journal": same,
    }
    out = {"run": run_info(), "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.json_path:
        path = pathlib.Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
