"""Suffix-structure scaling: time and memory per appended token as one group grows to 100K tokens.

A group of G responses (after a prompt) is appended in lock-step, one token per response per step,
as the engine does. At checkpoints we report, for the window since the previous checkpoint:
microseconds per appended token, microseconds per `speculate` call (chain γ=8), the states
walked per token (the bounded suffix-link chain: the per-token work), and the
structure's memory per token (tracemalloc, in a separate pass so it does not slow the timing).
Flat columns = amortised O(1) time and linear memory. Sources: `synthetic` (the replay study's
natural mix), `random` (no repeats: the most states) and `repetitive` (a few phrases repeated:
the longest suffix-link chains). Times are process CPU time (robust to other processes on a
shared machine). arctic-inference's suffix tree is timed on the same stream when
importable.

  python benchmarks/suffix_scaling.py --tokens 100000 --json /tmp/suffix_scaling.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc

import numpy as np

from seer_jax.analysis.synthetic_text import synthetic_groups
from seer_jax.drafting import DraftConfig, GroupDraftContext
from seer_jax.provenance import run_info


def token_stream(source: str, total: int, group_size: int, seed: int) -> tuple[list[int], list[list[int]]]:
    per = total // group_size + 1
    rng = np.random.default_rng(seed)
    if source == "synthetic":
        g = synthetic_groups(1, group_size, per, mix="natural", seed=seed, length_jitter=0.0)[0]
        return g.prompt_ids, [r[:per] for r in g.responses]
    if source == "random":
        return rng.integers(0, 32000, 64).tolist(), rng.integers(0, 32000, (group_size, per)).tolist()
    if source == "repetitive":
        phrases = [rng.integers(0, 50, int(rng.integers(5, 30))).tolist() for _ in range(8)]
        out = []
        for _ in range(group_size):
            r: list[int] = []
            while len(r) < per:
                r.extend(phrases[int(rng.integers(len(phrases)))])
            out.append(r[:per])
        return phrases[0], out
    raise SystemExit(f"unknown source {source!r}")


def checkpoints(total: int) -> list[int]:
    pts = [c for c in (1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000) if c < total]
    return pts + [total]


def chain_length(ctx: GroupDraftContext, request: str) -> int:
    """States on the request's count walk (its bounded suffix-link chain): the per-token work."""
    sam = ctx._sam
    w, c = sam._wstate[ctx._requests[request]], 0
    while w != -1:
        c += 1
        w = sam._link[w]
    return c


def run_ours(prompt, responses, total, memory: bool, spec_every: int) -> list[dict]:
    """Lock-step appends (one token per response per step), timed per step batch with
    process CPU time (robust to other processes on a shared machine)."""
    ctx = GroupDraftContext(DraftConfig(mode="group"), prompt)
    ids = [str(i) for i in range(len(responses))]
    for i in ids:
        ctx.start_request(i)
    cps = checkpoints(total)
    rows = []
    if memory:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    clock = time.process_time
    n = last_n = step = ci = 0
    t_app = t_spec = 0.0
    n_spec = chain_sum = chain_n = 0
    g = len(responses)
    while ci < len(cps):
        t0 = clock()
        for i in range(g):
            ctx.append(ids[i], (responses[i][step],))
        t_app += clock() - t0
        n += g
        if not memory and step % spec_every == 0:
            t0 = clock()
            for i in range(g):
                ctx.speculate(ids[i], 8, 8)
            t_spec += clock() - t0
            n_spec += g
            chain_sum += sum(chain_length(ctx, i) for i in ids)
            chain_n += g
        step += 1
        if n >= cps[ci]:
            row = {"tokens": n, "states": ctx.num_states()}
            if memory:
                row["bytes_per_token"] = (tracemalloc.get_traced_memory()[0] - base) / n
            else:
                row["us_per_append"] = 1e6 * t_app / (n - last_n)
                row["us_per_speculate"] = 1e6 * t_spec / max(n_spec, 1)
                row["walk_states_per_token"] = chain_sum / max(chain_n, 1)
            rows.append(row)
            t_app = t_spec = 0.0
            n_spec = chain_sum = chain_n = 0
            last_n = n
            ci += 1
    if memory:
        tracemalloc.stop()
    return rows


def run_arctic(prompt, responses, total) -> list[dict] | None:
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except Exception:
        return None
    cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=-1)
    for i in range(len(responses)):
        cache.start_request(i, np.asarray(prompt, np.int32))
    cps = checkpoints(total)
    rows, n, t_app, last_n, ci, step = [], 0, 0.0, 0, 0, 0
    clock = time.process_time
    while ci < len(cps):
        t0 = clock()
        for i, r in enumerate(responses):
            cache.add_active_response(i, [r[step]])
        t_app += clock() - t0
        n += len(responses)
        step += 1
        if n >= cps[ci]:
            rows.append({"tokens": n, "us_per_append": 1e6 * t_app / (n - last_n)})
            t_app, last_n = 0.0, n
            ci += 1
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--sources", default="synthetic,random,repetitive")
    ap.add_argument("--spec-every", type=int, default=4, help="time speculate every N steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    report = {"config": vars(args), "sources": {}}
    summary = {}
    for source in args.sources.split(","):
        prompt, responses = token_stream(source, args.tokens, args.group_size, args.seed)
        timing = run_ours(prompt, responses, args.tokens, memory=False, spec_every=args.spec_every)
        memory = run_ours(prompt, responses, args.tokens, memory=True, spec_every=args.spec_every)
        arctic = run_arctic(prompt, responses, args.tokens)
        rows = []
        for k, (t, m) in enumerate(zip(timing, memory, strict=True)):
            row = {**t, "bytes_per_token": m["bytes_per_token"]}
            if arctic:
                row["arctic_us_per_append"] = arctic[k]["us_per_append"]
            rows.append(row)
        report["sources"][source] = rows
        first, last = rows[0], rows[-1]
        summary[source] = {
            "us_per_append_first_window": first["us_per_append"],
            "us_per_append_last_window": last["us_per_append"],
            "us_per_append_ratio_last_vs_first": last["us_per_append"] / first["us_per_append"],
            "bytes_per_token_at_end": last["bytes_per_token"],
            "bytes_per_token_ratio_last_vs_first": last["bytes_per_token"] / first["bytes_per_token"],
            "us_per_speculate_last_window": last["us_per_speculate"],
            "states_per_token": last["states"] / last["tokens"],
        }
        if arctic:
            summary[source]["us_per_append_ratio_vs_arctic"] = (
                sum(r["us_per_append"] for r in rows) / sum(r["arctic_us_per_append"] for r in rows)
            )
        print(f"\n[{source}] G={args.group_size}")
        hdr = (f"{'tokens':>8} {'states':>8} {'walk':>5} {'us/append':>10} {'us/spec':>8} "
               f"{'B/token':>8}")
        if arctic:
            hdr += f" {'arctic us/append':>17}"
        print(hdr)
        for r in rows:
            line = (f"{r['tokens']:>8} {r['states']:>8} {r['walk_states_per_token']:>5.2f} "
                    f"{r['us_per_append']:>10.2f} "
                    f"{r['us_per_speculate']:>8.2f} {r['bytes_per_token']:>8.0f}")
            if arctic:
                line += f" {r['arctic_us_per_append']:>17.2f}"
            print(line)
    report["summary"] = summary
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "run": run_info()}, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
