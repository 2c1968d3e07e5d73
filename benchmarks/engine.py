"""Paged engine throughput vs the dense reference generator and HF transformers (CPU).

SmolLM2-135M-Instruct (f32), P chat prompts x G samples each (default 8 x 8 = 64 requests) with
ragged per-request max_tokens (deterministic, uniform in [--min-tokens, --max-tokens]),
temperature 1.0, seeded. Systems, each warmed up first (JIT compiles / first-call costs excluded
from the timed run and reported separately):

  engine       seer_jax.engine.engine.Engine: continuous batching, chunked prefill, paged KV,
               group prefix sharing; every request stops at its own max_tokens / EOS.
  engine_sync  (only when named in --systems) the same engine one step at a time
               (EngineConfig.overlap off)
  reference    seer_jax.model.generate.generate: one padded batch, prefill + lax.scan decode for
               max(max_tokens) steps; useful tokens = each row's tokens up to its own max / EOS.
  transformers HF `generate` (torch CPU, same GGUF weights dequantized to f32, left-padded batch,
               max_new_tokens = max(max_tokens), torch.set_num_threads(--torch-threads)); useful
               tokens counted as for the reference.

Output tokens/s = useful generated tokens (EOS included) / wall seconds of the timed run.

  python benchmarks/engine.py --json /tmp/engine.json
  python benchmarks/engine.py --num-prompts 2 --group-size 4 --max-tokens 32 --min-tokens 16  # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from seer_jax.provenance import run_info


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]  # one per request (group-mates repeat the prompt)
    max_tokens: list[int]
    seeds: list[int]
    eos_ids: tuple[int, ...]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def make_workload(tok, eos_ids, num_prompts: int, group_size: int, min_tokens: int, max_tokens: int,
                  seed: int) -> Workload:
    from seer_jax.rollout.core.prompts import prompt_set

    items = prompt_set("natural")[:num_prompts]
    chats = [tok.encode_chat([{"role": "user", "content": it.text}]) for it in items]
    rng = np.random.default_rng(seed)
    n = len(chats) * group_size
    lens = rng.integers(min_tokens, max_tokens + 1, size=n).tolist()
    return Workload(prompts=[list(chats[i // group_size]) for i in range(n)], max_tokens=lens,
                    seeds=[seed * 1_000_003 + i for i in range(n)], eos_ids=tuple(eos_ids))


def useful_len(row: list[int], max_tokens: int, eos_ids: tuple[int, ...]) -> int:
    """Tokens of a padded-batch row that a per-request engine would have produced."""
    row = row[:max_tokens]
    for j, t in enumerate(row):
        if t in eos_ids:
            return j + 1
    return len(row)


# ---------------------------------------------------------------------------- systems


def run_engine(cfg, params, wl: Workload, args, seed_offset: int = 0, overlap: bool = True) -> dict:
    from seer_jax.engine import model_runner
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.rollout.core.types import SamplingParams

    ecfg = EngineConfig(page_size=args.page_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_prefill_seqs=args.max_prefill_seqs,
                        kv_memory_gib=args.kv_memory_gib, overlap=overlap)
    eng = Engine(cfg, params, ecfg, eos_ids=wl.eos_ids)
    traces0 = model_runner.TRACE_COUNTS["step"]
    t0 = time.perf_counter()
    for i, p in enumerate(wl.prompts):
        eng.add_request(str(i), p, wl.max_tokens[i],
                        SamplingParams(temperature=args.temperature, seed=wl.seeds[i] + seed_offset))
    out = eng.run_until_done()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in out.values())
    stats = eng.step_stats
    durs = np.array([s.duration_s for s in stats])
    dec_only = np.array([s.num_prefill_tokens == 0 for s in stats])
    return {
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": len(stats),
        "compiles": model_runner.TRACE_COUNTS["step"] - traces0,
        "step_ms_mean": 1e3 * float(durs.mean()) if len(durs) else 0.0,
        "decode_step_ms_mean": 1e3 * float(durs[dec_only].mean()) if dec_only.any() else 0.0,
        "mixed_step_ms_mean": 1e3 * float(durs[~dec_only].mean()) if (~dec_only).any() else 0.0,
        "num_mixed_steps": int((~dec_only).sum()),
        "mean_batch": float(np.mean([s.batch_size for s in stats])) if stats else 0.0,
        "preemptions": eng.num_preemptions,
        "eos_finished": sum(r.finish_reason == "eos" for r in out.values()),
    }


def run_reference(cfg, params, wl: Workload, args) -> dict:
    from seer_jax.model.generate import generate
    from seer_jax.rollout.core.types import SamplingParams

    sps = [SamplingParams(temperature=args.temperature, seed=s) for s in wl.seeds]
    t0 = time.perf_counter()
    gens = generate(params, cfg, wl.prompts, max(wl.max_tokens), sps, eos_ids=wl.eos_ids)
    wall = time.perf_counter() - t0
    tokens = sum(useful_len(g.token_ids, m, wl.eos_ids) for g, m in zip(gens, wl.max_tokens, strict=True))
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "padded_tokens": len(gens) * max(wl.max_tokens)}


class HFSystem:
    def __init__(self, gguf_path: str, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
            torch_dtype=torch.float32)
        self.model.eval()

    def run(self, wl: Workload, max_new: int, temperature: float, seed: int) -> dict:
        torch = self.torch
        T = max(len(p) for p in wl.prompts)
        pad = wl.eos_ids[0] if wl.eos_ids else 0
        ids = torch.full((wl.num_requests, T), pad, dtype=torch.long)
        mask = torch.zeros((wl.num_requests, T), dtype=torch.long)
        for i, p in enumerate(wl.prompts):  # left padding
            ids[i, T - len(p):] = torch.tensor(p)
            mask[i, T - len(p):] = 1
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None, top_p=1.0, top_k=0,
                eos_token_id=list(wl.eos_ids) or None, pad_token_id=pad)
        wall = time.perf_counter() - t0
        rows = out[:, T:].tolist()
        tokens = sum(useful_len(r, m, wl.eos_ids) for r, m in zip(rows, wl.max_tokens, strict=True))
        return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                "generated_steps": len(rows[0]) if rows else 0}


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128, help="largest per-request max_tokens")
    ap.add_argument("--min-tokens", type=int, default=32, help="smallest per-request max_tokens")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default="engine,reference,transformers")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-prefill-seqs", type=int, default=8)
    ap.add_argument("--kv-memory-gib", type=float, default=0.5)
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.min_tokens > args.max_tokens or args.min_tokens < 1:
        ap.error("need 1 <= --min-tokens <= --max-tokens")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in ("engine", "engine_sync", "reference", "transformers"):
            ap.error(f"unknown system {s!r}")

    from rich.console import Console
    from rich.table import Table

    from seer_jax.model import load
    from seer_jax.model.hub import resolve_model

    console = Console()
    t_load = time.perf_counter()
    cfg, params, tok = load("smollm2", "float32")
    eos = tuple(cfg.eos_token_ids) or ((tok.eos_id,) if tok.eos_id is not None else ())
    wl = make_workload(tok, eos, args.num_prompts, args.group_size, args.min_tokens, args.max_tokens,
                       args.seed)
    console.print(f"loaded SmolLM2 in {time.perf_counter() - t_load:.1f}s; {wl.num_requests} requests, "
                  f"prompt lengths {sorted({len(p) for p in wl.prompts})}, max_tokens "
                  f"{min(wl.max_tokens)}..{max(wl.max_tokens)} (sum {sum(wl.max_tokens)})")

    results: dict[str, dict] = {}
    if "engine" in systems:
        # Warm-up: the same workload (same seeds -> same schedule -> every bucket compiled).
        w = run_engine(cfg, params, wl, args)
        r = run_engine(cfg, params, wl, args)
        r["warmup_s"] = w["wall_s"]
        r["compile_s_est"] = max(0.0, w["wall_s"] - r["wall_s"])
        r["warmup_compiles"] = w["compiles"]
        results["engine"] = r
        console.print(f"engine: {r}")
    if "engine_sync" in systems:  # the engine one step at a time (EngineConfig.overlap off)
        w = run_engine(cfg, params, wl, args, overlap=False)
        r = run_engine(cfg, params, wl, args, overlap=False)
        r["warmup_s"] = w["wall_s"]
        r["compile_s_est"] = max(0.0, w["wall_s"] - r["wall_s"])
        results["engine_sync"] = r
        console.print(f"engine_sync: {r}")
    if "reference" in systems:
        w = run_reference(cfg, params, wl, args)  # compiles _generate for these shapes
        r = run_reference(cfg, params, wl, args)
        r["warmup_s"] = w["wall_s"]
        r["compile_s_est"] = max(0.0, w["wall_s"] - r["wall_s"])
        results["reference"] = r
        console.print(f"reference: {r}")
    if "transformers" in systems:
        t0 = time.perf_counter()
        hf = HFSystem(str(resolve_model("smollm2")), args.torch_threads)
        load_s = time.perf_counter() - t0
        small = Workload(wl.prompts[:4], wl.max_tokens[:4], wl.seeds[:4], wl.eos_ids)
        w = hf.run(small, 4, args.temperature, args.seed)
        r = hf.run(wl, max(wl.max_tokens), args.temperature, args.seed)
        r["load_s"] = load_s
        r["warmup_s"] = w["wall_s"]
        results["transformers"] = r
        console.print(f"transformers: {r}")

    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    summary: dict = {"tokens_per_s": tps, "num_requests": wl.num_requests}
    if "engine" in tps:
        if "transformers" in tps:
            summary["tokens_per_s_ratio_vs_transformers"] = tps["engine"] / tps["transformers"]
        if "reference" in tps:
            summary["tokens_per_s_ratio_vs_reference"] = tps["engine"] / tps["reference"]
        if "engine_sync" in tps:
            summary["tokens_per_s_ratio_vs_engine_sync"] = tps["engine"] / tps["engine_sync"]
        summary["engine_compile_s"] = results["engine"]["compile_s_est"]
        summary["engine_timed_run_compiles"] = results["engine"]["compiles"]

    table = Table(title=f"SmolLM2-135M f32, {wl.num_requests} requests "
                        f"({args.num_prompts} prompts x G={args.group_size}), CPU")
    for col in ("system", "output tokens", "wall s", "tokens/s", "ratio (engine / system)", "warm-up s"):
        table.add_column(col, justify="right" if col != "system" else "left")
    for k, v in results.items():
        ratio = tps["engine"] / v["tokens_per_s"] if "engine" in tps else float("nan")
        table.add_row(k, str(v["tokens"]), f"{v['wall_s']:.2f}", f"{v['tokens_per_s']:.1f}",
                      f"{ratio:.2f}x", f"{v.get('warmup_s', 0.0):.1f}")
    console.print(table)
    report = {
        "summary": summary,
        "config": vars(args),
        "workload": {"prompt_lens": [len(p) for p in wl.prompts], "max_tokens": wl.max_tokens},
        "systems": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "run": run_info()}, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
