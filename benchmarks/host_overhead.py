"""Where an engine decode step's time goes: host planning, transfers, device, commit (CPU).

For decode at batch B and context C (every request has C tokens of KV, imported with
`add_request(kv=...)`, so no prefill is needed to get there), with and without grouped
speculation, the engine's own per-step phase timings (`StepStats`) split a step into:

  plan     host: schedule, drafts, batch build (`Engine._plan`)
  h2d      the host's part of sending the step's inputs (packing, transfers dispatched; the
           device's receiving and unpacking them is in device)
  device   the compiled step, dispatch until its outputs are ready (block_until_ready)
  d2h      sampled tokens (and verify results) back to the host
  commit   host: emissions, appends, finishes, page roll-back, stats
  host     everything on the critical path that is not device time (plan + h2d + d2h + commit)
  wall     the step() call, measured around it
  host_cpu CPU time of the calling thread in the step() call (the device runs on XLA's own
           threads): the host work per step, less disturbed than wall-clock phases when other
           processes load the machine
  wait_cpu the part of host_cpu the thread spent blocked on the step's outputs
           (block_until_ready: waking up, not host work; `ModelRunner.wait_cpu_s`)
  host_work host_cpu - wait_cpu: the host's own work per step (planning, drafting, layout,
           dispatch, acceptance, commit)
  exposed  overlap only: host time on the critical path, an upper bound per step: zero when the
           host still had to wait for step N after dispatching N+1 (the device went from N to
           N+1 without idling), else the planning and dispatch of N+1; after a step that
           verified drafts (committed before N+1 is planned) its d2h and commit as well

Each point runs one step at a time (`overlap` off) and overlapped (on: step N+1 is planned and
dispatched while step N runs, then N is committed; its phases then no longer add up to the
wall time). The summary compares an overlapped step's wall time with max(device, host) of the
same point one step at a time. With speculation a step that verifies drafts is committed before
the next one is planned (the next step's positions and drafts follow its accepted tokens), so
there overlap hides only what does not wait for those tokens; its host work is the number to
watch (`--spec on`).

Models (random weights, greedy sampling, no EOS so the batch stays full):
  tiny     64 wide, 2 layers, 1 KV head of 16: device work is small, so host work shows
  medium   768 wide, 6 layers, heads of 32 (12 KV heads), as in benchmarks/distributed.py

Requests come in groups of 8 sharing a prompt (period-37 token pattern, so the group's draft
service finds drafts). Steps that compiled a new shape, or whose batch is not the full decode
batch, are left out of the statistics (counted in `excluded_steps`). A point whose KV cache (or,
with speculation, the CPU verify attention's buffers) would not fit `--mem-limit-gib`, or that
would overrun `--time-budget-s`, is skipped with the reason in the JSON.

  python benchmarks/host_overhead.py --json benchmarks/results/host_overhead/after.json
  python benchmarks/host_overhead.py --models tiny --batches 64 --contexts 1024 --steps 4  # quick
  python benchmarks/host_overhead.py --ab medium:64:1024,medium:256:1024 --json ab.json
  python benchmarks/host_overhead.py --ab tiny:256:8192:spec --ab-rounds 3 --ab-steps 2 --json ab.json
  python benchmarks/host_overhead.py --models tiny --batches 256 --contexts 8192 --spec on \
      --large-steps 8 --json spec.json  # a verify step's host work, overlap off and on

With --ab, each model:batch:context point runs two engines, overlap off and on, in alternating
blocks of steps, so that both see the same machine (on a busy machine a step's device time
moves by tens of percent between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from seer_jax.provenance import run_info  # noqa: E402

PHASES = ("plan", "h2d", "device", "d2h", "commit")
WAIT_MIN_S = 1e-4  # a blocking wait shorter than this is the call itself, not the device
GROUP = 8
PERIOD = 37


def model_config(name: str, max_len: int):
    from seer_jax.model.config import tiny_config

    if name == "tiny":
        return tiny_config(num_kv_heads=1, head_dim=16, max_position_embeddings=max_len,
                           eos_token_ids=(2,))
    if name == "medium":
        return tiny_config(hidden_size=768, intermediate_size=2 * 768, num_layers=6,
                           num_heads=768 // 32, num_kv_heads=768 // 64, head_dim=32,
                           max_position_embeddings=max_len, eos_token_ids=(7,))
    raise ValueError(f"unknown model {name!r}: allowed 'tiny', 'medium'")


def point_memory_gib(cfg, batch: int, ctx: int, spec: bool, page_size: int) -> tuple[float, float]:
    """(KV cache GiB, with speculation: the CPU verify attention's transient GiB per layer)."""
    pages = batch * (-(-(ctx + 256) // page_size) + 1)
    kv = pages * page_size * cfg.kv_bytes_per_token() / 2**30
    verify = 0.0
    if spec:
        # reference attention on gathered pages: K/V gathered + scores/mask over [B, q, Hq, ctx]
        q = 16
        verify = (2 * batch * ctx * cfg.kv_size * 4 + 3 * batch * q * cfg.num_heads * ctx * 4) / 2**30
    return kv, verify


def build_engine(model: str, batch: int, ctx: int, spec: bool, page_size: int, overlap: bool,
                 max_tokens: int):
    """An engine holding `batch` requests of `ctx` tokens of imported KV (admitted by its first
    step, not yet run)."""
    import jax

    from seer_jax.engine.engine import Engine, EngineConfig, KVBlob
    from seer_jax.model.llama import init_params
    from seer_jax.model.sampling_params import SamplingParams

    max_len = ctx + max_tokens
    cfg = model_config(model, max_len)
    params = init_params(cfg, jax.random.PRNGKey(0))
    pages_per_seq = -(-max_len // page_size)
    ecfg = EngineConfig(page_size=page_size, num_pages=batch * (pages_per_seq + 1),
                        max_num_seqs=batch, max_num_batched_tokens=batch, max_prefill_seqs=1,
                        max_model_len=max_len, speculation=spec, overlap=overlap)
    eng = Engine(cfg, params, ecfg, eos_ids=())
    rng = np.random.default_rng(0)
    zeros = np.zeros((cfg.num_layers, cfg.num_kv_heads, ctx - 1, cfg.head_dim), np.float32)
    for g in range(-(-batch // GROUP)):
        pattern = rng.integers(3, cfg.vocab_size, size=PERIOD).tolist()
        prompt = (pattern * (ctx // PERIOD + 1))[:ctx]
        for i in range(min(GROUP, batch - g * GROUP)):
            eng.add_request(f"{g}-{i}", prompt, max_tokens, SamplingParams(temperature=0.0),
                            kv=KVBlob(prompt, [], zeros, zeros), group_id=str(g))
    return eng


def run_point(model: str, batch: int, ctx: int, spec: bool, steps: int, warmup: int,
              page_size: int, overlap: bool = False) -> dict:
    max_tokens = 16 * (warmup + steps + 2) if spec else warmup + steps + 2
    t_setup = time.perf_counter()
    eng = build_engine(model, batch, ctx, spec, page_size, overlap, max_tokens)
    eng.step()  # admits every request (KV import) and runs the first decode
    setup_s = time.perf_counter() - t_setup
    t_run = time.perf_counter()
    walls = []  # wall and thread CPU time of each step() call, and whether it compiled
    for _ in range(warmup + steps):
        c0, w0, u0 = eng.runner.compile_s, time.perf_counter(), time.thread_time()
        b0 = eng.runner.wait_cpu_s
        eng.step()
        walls.append((time.perf_counter() - w0, eng.runner.compile_s > c0, time.thread_time() - u0,
                      eng.runner.wait_cpu_s - b0))
    run_s = time.perf_counter() - t_run
    eng.drain()  # with overlap: the last step's phases complete
    stats = list(eng.step_stats)[1 + warmup:]
    kept = [s for s in stats if s.compile_s == 0 and s.batch_size == batch
            and s.num_prefill_tokens == 0]
    steady_walls = [w for w, compiled, _, _ in walls[warmup:] if not compiled]
    steady_cpu = [u for _, compiled, u, _ in walls[warmup:] if not compiled]
    steady_wait = [b for _, compiled, _, b in walls[warmup:] if not compiled]
    out = {"status": "ok", "setup_s": round(setup_s, 2), "run_s": round(run_s, 2),
           "steps": len(stats), "excluded_steps": len(stats) - len(kept),
           "spec_steps": sum(s.num_decode_tokens > batch for s in kept),
           "tokens_per_step": float(np.mean([s.num_decode_tokens for s in kept])) if kept else 0.0}
    if not kept:
        out["status"] = "no steady-state step (every measured step compiled or was not full)"
        return out
    med = {p: float(np.median([getattr(s, f"{p}_s") for s in kept])) for p in PHASES}
    med["step"] = float(np.median([s.plan_s + s.h2d_s + s.device_s + s.d2h_s + s.commit_s
                                   for s in kept]))
    med["host"] = float(np.median([s.plan_s + s.h2d_s + s.d2h_s + s.commit_s for s in kept]))
    med["wall"] = float(np.median(steady_walls)) if steady_walls else float("nan")
    med["host_cpu"] = float(np.median(steady_cpu)) if steady_cpu else float("nan")
    med["wait_cpu"] = float(np.median(steady_wait)) if steady_wait else float("nan")
    med["host_work"] = (float(np.median(np.subtract(steady_cpu, steady_wait))) if steady_cpu
                        else float("nan"))
    if overlap:
        # step N+1 was dispatched before the host waited for step N; if the host then still had
        # to wait, N+1 was queued when N ended and the device did not idle between them: no
        # host time on the critical path. Otherwise the device may have idled for at most the
        # planning and dispatch of N+1 (an upper bound).
        ok = {id(s) for s in kept}
        pairs = [(a, b) for a, b in zip(stats, stats[1:], strict=False) if id(a) in ok and id(b) in ok]
        exposed = [a.d2h_s + a.commit_s + b.plan_s + b.h2d_s if a.num_decode_tokens > a.batch_size
                   else 0.0 if a.wait_s > WAIT_MIN_S else b.plan_s + b.h2d_s for a, b in pairs]
        if pairs:
            out["host_waited_share"] = round(sum(a.wait_s > WAIT_MIN_S for a, _ in pairs) / len(pairs), 3)
            med["exposed_host"] = float(np.median(exposed))
    out.update({f"{k}_ms": round(1e3 * v, 3) for k, v in med.items()})
    return out


def run_ab(model: str, batch: int, ctx: int, steps: int, rounds: int, warmup: int,
           page_size: int, spec: bool = False) -> dict:
    """Overlap off and on, in alternating blocks of `steps` decode steps (`rounds` each), so
    that both see the same machine: wall time per step of each (median over blocks), and the
    device and host time of the steps run one at a time. An overlapped block ends by
    committing its last step (`drain`), so its first planning and last commit are not hidden."""
    max_tokens = (16 if spec else 1) * (warmup + rounds * steps + 4)
    engines = {o: build_engine(model, batch, ctx, spec, page_size, o, max_tokens)
               for o in (False, True)}
    for eng in engines.values():
        for _ in range(1 + warmup):  # admission, then compiles
            eng.step()
    blocks: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for o, eng in engines.items():
            c0, t0 = eng.runner.compile_s, time.perf_counter()
            for _ in range(steps):
                eng.step()
            eng.drain()  # the block's last step ends within it (not during the other's block)
            if eng.runner.compile_s == c0:
                blocks[o].append((time.perf_counter() - t0) / steps)
    sync = [s for s in list(engines[False].step_stats)[1 + warmup:] if s.compile_s == 0]
    engines[True].drain()
    over = [s for s in list(engines[True].step_stats)[1 + warmup:] if s.compile_s == 0]
    if not (blocks[False] and blocks[True] and sync):
        return {"status": "no steady-state block"}
    device = float(np.median([s.device_s for s in sync]))
    host = float(np.median([s.plan_s + s.h2d_s + s.d2h_s + s.commit_s for s in sync]))
    off, on = float(np.median(blocks[False])), float(np.median(blocks[True]))
    return {"status": "ok", "rounds": rounds, "steps_per_block": steps,
            "wall_off_ms": round(1e3 * off, 3), "wall_on_ms": round(1e3 * on, 3),
            "device_ms": round(1e3 * device, 3), "host_ms": round(1e3 * host, 3),
            "blocks_off_ms": [round(1e3 * b, 2) for b in blocks[False]],
            "blocks_on_ms": [round(1e3 * b, 2) for b in blocks[True]],
            # steps other than a block's last (committed by drain, with nothing dispatched after)
            "host_waited_share": round(float(np.mean(
                [s.wait_s > WAIT_MIN_S for i, s in enumerate(over) if i % steps != steps - 1])), 3),
            "overlap_wall_over_max_device_host": round(on / max(device, host), 3),
            "overlap_wall_over_sync_wall": round(on / off, 3)}


def markdown(points: list[dict]) -> str:
    head = ("| model | batch | ctx | spec | overlap | plan ms | h2d ms | device ms | d2h ms "
            "| commit ms | host ms | step ms | wall ms | exposed host ms | host CPU ms "
            "| wait CPU ms | host work ms |")
    rows = [head, "|" + "---|" * 17]
    for p in points:
        key = (f"| {p['model']} | {p['batch']} | {p['context']} | {'on' if p['spec'] else 'off'} "
               f"| {'on' if p.get('overlap') else 'off'} |")
        if p["status"] != "ok":
            rows.append(key + f" {p['status']} |" + " |" * 12)
            continue
        rows.append(key + "".join(f" {p[f'{k}_ms']:.2f} |" for k in (*PHASES, "host", "step", "wall"))
                    + (f" {p['exposed_host_ms']:.3f} |" if "exposed_host_ms" in p else " |")
                    + f" {p['host_cpu_ms']:.2f} | {p['wait_cpu_ms']:.2f} | {p['host_work_ms']:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,medium")
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--spec", default="off,on", help="speculation settings to run: off, on")
    ap.add_argument("--overlap", default="off,on",
                    help="overlapped steps (EngineConfig.overlap) to run: off, on")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per point")
    ap.add_argument("--large-steps", type=int, default=3,
                    help="measured steps where batch * context >= --large-tokens")
    ap.add_argument("--large-tokens", type=int, default=2**21)
    ap.add_argument("--warmup", type=int, default=2, help="steps after admission, not measured")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--mem-limit-gib", type=float, default=10.0)
    ap.add_argument("--time-budget-s", type=float, default=840.0)
    ap.add_argument("--ab", default="",
                    help="model:batch:context[:spec] points (comma-separated) to run with overlap "
                         "off and on in alternating blocks, instead of the grid (:spec: with "
                         "grouped speculation)")
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--ab-steps", type=int, default=3, help="steps per block")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, help="also write the table here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in args.batches.split(",") if b]
    contexts = [int(c) for c in args.contexts.split(",") if c]
    specs = [{"off": False, "on": True}[s] for s in args.spec.split(",") if s]
    overlaps = [{"off": False, "on": True}[s] for s in args.overlap.split(",") if s]

    t_start = time.perf_counter()
    if args.ab:
        return run_ab_points(args, t_start)
    points = []
    # cheapest first, so a time budget cuts the large points
    grid = sorted(((m, b, c, s, o) for m in models for s in specs for b in batches
                   for c in contexts for o in overlaps),
                  key=lambda p: (p[0] != "tiny", p[1] * p[2], p[3], p[4]))
    for model, batch, ctx, spec, overlap in grid:
        cfg = model_config(model, ctx + 1024)
        kv_gib, verify_gib = point_memory_gib(cfg, batch, ctx, spec, args.page_size)
        point = {"model": model, "batch": batch, "context": ctx, "spec": spec,
                 "overlap": overlap, "kv_gib": round(kv_gib, 2)}
        elapsed = time.perf_counter() - t_start
        if kv_gib + verify_gib > args.mem_limit_gib:
            point["status"] = (f"skipped: KV cache {kv_gib:.1f} GiB"
                               + (f" + CPU verify attention {verify_gib:.1f} GiB" if spec else "")
                               + f" > --mem-limit-gib {args.mem_limit_gib}")
        elif elapsed > args.time_budget_s:
            point["status"] = f"skipped: time budget ({args.time_budget_s:.0f} s) spent"
        else:
            steps = args.large_steps if batch * ctx >= args.large_tokens else args.steps
            try:
                point.update(run_point(model, batch, ctx, spec, steps, args.warmup, args.page_size,
                                       overlap))
            except Exception as e:  # recorded, the sweep goes on
                point["status"] = f"failed: {type(e).__name__}: {e}"[:300]
        points.append(point)
        print(json.dumps(point), flush=True)

    ok = [p for p in points if p["status"] == "ok"]

    def find(model, batch, ctx, spec=False, overlap=False):
        return next((p for p in ok if (p["model"], p["batch"], p["context"], p["spec"],
                                       p["overlap"]) == (model, batch, ctx, spec, overlap)), None)

    summary = {"points_ok": len(ok), "points": len(points),
               "wall_s": round(time.perf_counter() - t_start, 1)}
    for model in models:
        for spec in specs:
            tag = f"{model}{'_spec' if spec else ''}"
            p8, p1, p32 = (find(model, 256, c, spec) for c in (8192, 1024, 32768))
            if p8:
                summary[f"{tag}_host_ms_b256_ctx8k"] = p8["host_ms"]
                summary[f"{tag}_host_cpu_ms_b256_ctx8k"] = p8["host_cpu_ms"]
                summary[f"{tag}_host_work_ms_b256_ctx8k"] = p8["host_work_ms"]
            o8 = find(model, 256, 8192, spec, True)
            if o8:
                summary[f"{tag}_overlap_host_cpu_ms_b256_ctx8k"] = o8["host_cpu_ms"]
                summary[f"{tag}_overlap_host_work_ms_b256_ctx8k"] = o8["host_work_ms"]
            if o8 and "exposed_host_ms" in o8:
                summary[f"{tag}_overlap_exposed_host_ms_b256_ctx8k"] = o8["exposed_host_ms"]
                summary[f"{tag}_overlap_host_waited_share_b256_ctx8k"] = o8["host_waited_share"]
            if p1 and p32:
                summary[f"{tag}_host_ratio_b256_ctx32k_over_1k"] = round(p32["host_ms"] / p1["host_ms"], 2)
        # overlapped wall time per step against max(device, host) of the same point one step
        # at a time
        for p in ok:
            on = find(model, p["batch"], p["context"], p["spec"], True) if p["model"] == model \
                and not p["overlap"] else None
            if on:
                key = f"{model}{'_spec' if p['spec'] else ''}_b{p['batch']}_ctx{p['context']}"
                summary[f"{key}_overlap_wall_over_max_device_host"] = round(
                    on["wall_ms"] / max(p["device_ms"], p["host_ms"]), 3)
                summary[f"{key}_overlap_wall_over_sync_wall"] = round(on["wall_ms"] / p["wall_ms"], 3)
    report = {"summary": summary, "run": run_info(), "args": vars(args), "points": points}
    table = markdown(points)
    print(table)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


def run_ab_points(args, t_start: float) -> int:
    ab = []
    for item in args.ab.split(","):
        model, batch, ctx, *spec = item.split(":")
        spec = spec == ["spec"]
        point = {"model": model, "batch": int(batch), "context": int(ctx), "spec": spec}
        kv_gib, _ = point_memory_gib(model_config(model, int(ctx) + 1024), int(batch), int(ctx),
                                     False, args.page_size)
        if 2 * kv_gib > args.mem_limit_gib:
            point["status"] = f"skipped: two KV caches of {kv_gib:.1f} GiB > --mem-limit-gib"
        else:
            point.update(run_ab(model, int(batch), int(ctx), args.ab_steps, args.ab_rounds,
                                args.warmup, args.page_size, spec))
        ab.append(point)
        print(json.dumps(point), flush=True)
    summary = {f"{p['model']}{'_spec' if p['spec'] else ''}_b{p['batch']}_ctx{p['context']}_{k}": p[k]
               for p in ab
               if p["status"] == "ok" for k in ("overlap_wall_over_max_device_host",
                                                "overlap_wall_over_sync_wall", "host_waited_share")}
    summary["wall_s"] = round(time.perf_counter() - t_start, 1)
    report = {"summary": summary, "run": run_info(), "args": vars(args), "ab": ab}
    print(json.dumps(summary, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
