"""`seer-jax bench --profile`: measure the engine's step time T(B, γ) on this hardware.

Each point runs the real jitted engine step (paged attention, sampling) on a decode region of B
sequences with 1+γ query tokens each (γ draft tokens verified along a chain) over `--context`
tokens of KV, and records the median step time. The JSON (`seer_jax.step_profile/v1`) feeds the
speculation budget (`rollout.drafting.budget`) and the simulator's calibrated cost model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

NAME = "bench"
HELP = "Measure engine step times; --profile writes a T(B, gamma) step-time profile (JSON)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", action="store_true", help="measure the T(B, gamma) grid")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--gammas", default="0,1,2,4,8")
    p.add_argument("--context", type=int, default=256, help="KV tokens per sequence")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", dest="json_path", default=None, help="write the profile here")


def _ints(text: str, flag: str) -> list[int]:
    from seer_jax.errors import InputError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise InputError(f"{flag} must list non-negative integers, got {text!r}")
    return vals


def measure_step(runner, B: int, gamma: int, context: int, page_size: int, iters: int) -> float:
    """Median time of one jitted step: B sequences × (1+gamma) query tokens over `context` KV."""
    import numpy as np

    from seer_jax.engine.batch import DraftTree, Layout, Region, StepBatch, bucket

    q = 1 + gamma
    pps = bucket(-(-(context + q) // page_size), 4)
    layout = Layout(n_dec=B, q_dec=q, n_pre=0, t_pre=0, pps=pps)
    n_pages = runner.num_pages
    pages = (np.arange(B * pps).reshape(B, pps) % n_pages).astype(np.int32)
    kv_lens = np.full(B, context + q, np.int32)
    pos = (context + np.arange(q))[None, :].repeat(B, 0)
    slots = (pages[np.arange(B)[:, None], pos // page_size] * page_size + pos % page_size).reshape(-1)
    R = layout.num_rows
    draft = DraftTree(np.tile(np.arange(-1, q - 1, dtype=np.int32), B)) if gamma else None
    batch = StepBatch(
        layout, tokens=np.ones(B * q, np.int32), positions=pos.reshape(-1).astype(np.int32),
        slots=slots.astype(np.int32), logits_index=np.arange(R, dtype=np.int32),
        temperature=np.ones(R, np.float32), top_p=np.ones(R, np.float32),
        top_k=np.zeros(R, np.int32), seeds=np.arange(R, dtype=np.uint32),
        gen_index=np.zeros(R, np.int32),
        dec=Region((np.arange(B + 1) * q).astype(np.int32), kv_lens, pages, B), draft=draft)
    runner.sample(batch)  # compile
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.sample(batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> int:
    import jax

    from seer_jax.engine.model_runner import ModelRunner
    from seer_jax.errors import InputError
    from seer_jax.model import load
    from seer_jax.provenance import run_info

    if not args.profile:
        raise InputError("nothing to do: pass --profile")
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    gammas = _ints(args.gammas, "--gammas")
    if min(batch_sizes) < 1:
        raise InputError("--batch-sizes must be >= 1")
    cfg, params, _ = load(args.model, args.dtype)
    max_pages = max(batch_sizes) * (-(-(args.context + max(gammas) + 1) // args.page_size) + 4) * 2
    runner = ModelRunner(cfg, params, max_pages, args.page_size)
    points = []
    for B in batch_sizes:
        for g in gammas:
            t = measure_step(runner, B, g, args.context, args.page_size, args.iters)
            points.append({"batch_size": B, "gamma": g, "num_tokens": B * (1 + g),
                           "kv_tokens": B * (args.context + 1 + g), "step_s": t})
            print(f"B={B:4d} gamma={g}  step {t * 1e3:8.2f} ms  ({B * (1 + g) / t:8.1f} query tok/s)")
    base = {p["batch_size"]: p["step_s"] for p in points if p["gamma"] == 0}
    profile = {
        "schema": "seer_jax.step_profile/v1", "model": args.model,
        "device": f"{jax.default_backend()} x{jax.device_count()}", "page_size": args.page_size,
        "points": points,
        "summary": {"num_points": len(points),
                    "decode_step_s": {str(b): t for b, t in base.items()},
                    "max_gamma_step_ratio_vs_decode": max(
                        p["step_s"] / base[p["batch_size"]] for p in points if p["batch_size"] in base)
                    if base else None},
        "run": run_info(),
    }
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(profile, f, indent=1)
        print(f"wrote {args.json_path}")
    return 0
