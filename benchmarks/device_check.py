"""Device check for the Pallas kernels and the engine: one script, JSON out.

On a GPU (the target: one H200, under 8 minutes) it measures, with the GPU kernels:
  correctness   kernels vs the jnp reference (decode, mixed prefill+decode, verify tree; f32 and
                bf16; KV write into a layered cache)
  decode        decode attention achieved HBM GB/s and fraction of peak, batch 1-256 x context
                1K-32K (Llama-3-8B per-device heads: 32 q / 8 KV, head_dim 128, bf16, page 16)
  prefill       causal prefill attention TFLOP/s
  engine        engine decode tokens/s for a SmolLM2-135M-shaped and a Llama-3-8B-shaped model
                (random bf16 weights) at batch 1/32/128, kernels vs the engine's reference path;
                the 8B decode step against the time to read its weights and KV once
  acceptance    draft acceptance (XLA) as a share of a verify step
On a TPU the same runs with the TPU kernels. `--dry-run` runs every section end to end at tiny
shapes on CPU with the kernels in interpret mode (CI keeps it from rotting).

  python benchmarks/device_check.py --out device_check.json
  python benchmarks/device_check.py --dry-run --out /tmp/device_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

HBM_PEAK_GBPS = {"gpu": 4800.0, "tpu": 2765.0, "cpu": 0.0}  # H200; v5p
MAX_POOL_BYTES = 40e9


def _timeit(fn, *args, iters: int = 10) -> float:
    """Median seconds per call (after one warm-up call)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


class Ctx:
    def __init__(self, dry: bool):
        import jax

        self.dry = dry
        self.backend = jax.default_backend()
        self.impl = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}.get(self.backend, "gpu")
        self.interpret = self.backend == "cpu"
        self.iters = 2 if dry else 10
        self.peak = HBM_PEAK_GBPS.get("gpu" if self.impl == "gpu" else "tpu", 0.0)
        self.deadline = float("inf")  # set by main from --budget-s

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline


# ------------------------------------------------------------------------------ correctness


def section_correctness(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp

    from seer_jax.pallas import ragged_paged_attention, write_kv
    from seer_jax.pallas.testing import make_batch

    tree = [-1, 0, 0, 1, 2, 2, 4, -1, 7]
    cases = [
        ("decode_gqa4_d128", [(1, 700), (1, 33), (1, 1500)], 32, 8, 128, None),
        ("mixed_gqa3_d64", [(1, 300), (40, 90), (9, 64)], 9, 3, 64, None),
        ("tree_gqa7_d128", [(1, 200), (9, 120)], 28, 4, 128, {1: tree}),
    ]
    if ctx.dry:
        cases = [("mixed_gqa2_d64", [(1, 40), (5, 18), (9, 30)], 4, 2, 64, {2: tree})]
    rows = []
    dtypes = ((np.float32, 1e-4),) if ctx.dry else ((np.float32, 1e-4), (jnp.bfloat16, 2e-2))
    for name, seqs, hq, hkv, d, trees in cases:
        for dtype, tol in dtypes:
            b = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16,
                           max_seqs=len(seqs) + 1, dtype=dtype, trees=trees)
            args = [jnp.asarray(a) for a in b.args()]
            tp = None if b.tree_parents is None else jnp.asarray(b.tree_parents)
            ref = ragged_paged_attention(*args, tree_parents=tp, impl="reference")
            out = ragged_paged_attention(*args, tree_parents=tp, impl=ctx.impl,
                                         interpret=ctx.interpret)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            rows.append(dict(case=name, dtype=str(jnp.dtype(dtype)), max_abs_err=err, tol=tol,
                             ok=bool(err <= tol)))
    # KV write into a layered cache, in place.
    kv = jnp.zeros((3, 8, 16, 4, 64), jnp.bfloat16)  # [L, P, S, 2 * Hkv, D]
    new = jax.random.normal(jax.random.key(0), (5, 2, 64)).astype(jnp.bfloat16)
    slots = jnp.array([0, 17, 40, -1, 127], jnp.int32)
    got = write_kv(kv, new, -new, slots, impl=ctx.impl, interpret=ctx.interpret, layer=1)
    want = write_kv(kv, new, -new, slots, impl="reference", layer=1)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    rows.append(dict(case="write_kv_layered", dtype="bfloat16", max_abs_err=err, tol=0.0,
                     ok=bool(err == 0.0)))
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows)}


# ------------------------------------------------------------------------------ attention speed


def _decode_pool(ctx: Ctx, hkv, d, page_size, total_pages, dtype):
    import jax

    shape = (total_pages, page_size, 2 * hkv, d)  # combined K/V cache (seer_jax.pallas.kv_layout)
    return jax.jit(lambda k: jax.random.normal(k, shape, dtype))(jax.random.key(1))


def section_decode(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp

    from seer_jax.pallas import ragged_paged_attention

    hq, hkv, d, ps, dtype = 32, 8, 128, 16, jnp.bfloat16
    batches, contexts = (1, 8, 32, 128, 256), (1024, 4096, 16384, 32768)
    if ctx.dry:
        hq, hkv, d, batches, contexts = 4, 2, 64, (2,), (64,)
    kv_token_bytes = 2 * hkv * d * jnp.dtype(dtype).itemsize
    cap = max(b * c for b in batches for c in contexts if b * c * kv_token_bytes <= MAX_POOL_BYTES)
    kv_pages = _decode_pool(ctx, hkv, d, ps, cap // ps, dtype)
    rows = []
    for c in contexts:
        for b in batches:
            if b * c * kv_token_bytes > MAX_POOL_BYTES or ctx.out_of_time():
                continue
            pps = c // ps
            pages = jnp.arange(b * pps, dtype=jnp.int32).reshape(b, pps)
            q = jax.random.normal(jax.random.key(b), (b, hq, d), dtype)
            kv_lens = jnp.full((b,), c, jnp.int32)
            cu = jnp.arange(b + 1, dtype=jnp.int32)
            fn = jax.jit(lambda q, kv, kl, p, cu, n: ragged_paged_attention(
                q, kv, kl, p, cu, n, impl=ctx.impl, interpret=ctx.interpret))
            t = _timeit(fn, q, kv_pages, kv_lens, pages, cu, jnp.int32(b), iters=ctx.iters)
            gbps = b * c * kv_token_bytes / t / 1e9
            rows.append(dict(batch=b, context=c, ms=t * 1e3, hbm_gbps=gbps,
                             frac_of_peak=gbps / ctx.peak if ctx.peak else None))
    big = [r["frac_of_peak"] for r in rows
           if r["batch"] >= 32 and r["context"] >= 4096 and r["frac_of_peak"] is not None]
    return {"shape": dict(q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps, dtype="bfloat16"),
            "peak_gbps": ctx.peak, "rows": rows,
            "min_frac_batch32_ctx4k": min(big) if big else None,
            "target_frac": 0.6}


def section_prefill(ctx: Ctx) -> dict:
    import jax
    import jax.numpy as jnp

    from seer_jax.pallas import ragged_paged_attention

    hq, hkv, d, ps, dtype = 32, 8, 128, 16, jnp.bfloat16
    shapes = ((4, 2048), (1, 8192))
    if ctx.dry:
        hq, hkv, d, shapes = 4, 2, 64, ((2, 32),)
    rows = []
    for nseq, L in shapes:
        pps = L // ps
        kv_pages = _decode_pool(ctx, hkv, d, ps, nseq * pps, dtype)
        q = jax.random.normal(jax.random.key(2), (nseq * L, hq, d), dtype)
        pages = jnp.arange(nseq * pps, dtype=jnp.int32).reshape(nseq, pps)
        kv_lens = jnp.full((nseq,), L, jnp.int32)
        cu = jnp.arange(nseq + 1, dtype=jnp.int32) * L
        fn = jax.jit(lambda q, kv, kl, p, cu, n: ragged_paged_attention(
            q, kv, kl, p, cu, n, impl=ctx.impl, interpret=ctx.interpret))
        t = _timeit(fn, q, kv_pages, kv_lens, pages, cu, jnp.int32(nseq), iters=ctx.iters)
        flops = 4.0 * hq * d * nseq * L * (L + 1) / 2  # QK^T and PV over the causal half
        rows.append(dict(seqs=nseq, seq_len=L, ms=t * 1e3, tflops=flops / t / 1e12))
    return {"rows": rows}


# ------------------------------------------------------------------------------ engine


SMOLLM2 = dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
               intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
               rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
               tie_word_embeddings=True)
LLAMA3_8B = dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                 head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=8192, tie_word_embeddings=False)
TINY = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
            intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
            rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=1024,
            tie_word_embeddings=False)


def random_params(cfg, seed: int = 0):
    """Random weights of the model's shapes, made on the device (no host init)."""
    import jax
    import jax.numpy as jnp

    from seer_jax.model.llama import init_params, jnp_dtype

    shapes = jax.eval_shape(lambda: init_params(cfg, seed))
    leaves, tree = jax.tree.flatten(shapes)
    dtype = jnp_dtype(cfg)
    out = []
    for i, s in enumerate(leaves):
        if len(s.shape) <= 1 or s.shape[-1] == 1:
            out.append(jnp.ones(s.shape, dtype))
        else:
            make = jax.jit(lambda k, shape=s.shape: (0.02 * jax.random.normal(k, shape, jnp.float32)
                                                     ).astype(dtype))
            out.append(make(jax.random.key(seed * 1000 + i)))
    return jax.tree.unflatten(tree, out)


def _engine_run(cfg, params, impl: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.model.sampling import SamplingParams

    ps = 16
    pages = batch * (-(-(prompt_len + new_tokens) // ps) + 1) + 8
    ec = EngineConfig(num_pages=pages, page_size=ps, max_num_seqs=batch,
                      max_num_batched_tokens=max(256, min(8192, batch * prompt_len)),
                      max_prefill_seqs=min(batch, 8), impl=impl)
    rng = np.random.default_rng(0)

    def once():
        eng = Engine(cfg, params, ec)
        for i in range(batch):
            eng.add_request(str(i), rng.integers(3, cfg.vocab_size, prompt_len).tolist(),
                            new_tokens, SamplingParams(temperature=0.0))
        t0 = time.perf_counter()
        n = 0
        while eng.has_unfinished():
            n += sum(len(r.token_ids) for r in eng.step())
        return eng, n, time.perf_counter() - t0

    once()  # compiles every step shape
    eng, n, wall = once()
    stats = getattr(eng, "step_stats", [])
    dec = [s.duration_s for s in stats
           if s.num_prefill_tokens == 0 and s.batch_size == batch]
    step = float(np.median(dec)) if dec else None
    return dict(impl=eng.runner.impl, batch=batch, tokens=n, wall_s=wall, tokens_per_s=n / wall,
                decode_step_ms=None if step is None else step * 1e3,
                decode_tokens_per_s=None if step is None else batch / step)


def section_engine(ctx: Ctx) -> dict:
    import jax

    from seer_jax.model.config import ModelConfig

    models = [("smollm2_135m", SMOLLM2, (1, 32, 128)), ("llama3_8b", LLAMA3_8B, (1, 32, 128))]
    prompt_len, new_tokens = 64, 32
    if ctx.dry:
        models, prompt_len, new_tokens = [("tiny", TINY, (2,))], 12, 3
    out = {}
    for name, dims, batches in models:
        cfg = ModelConfig(**dims, eos_token_ids=(), dtype="float32" if ctx.dry else "bfloat16")
        params = random_params(cfg)
        rows = []
        for b in batches:
            for impl in (ctx.impl, "reference"):
                if ctx.out_of_time():
                    rows.append(dict(impl=impl, batch=b, skipped="time budget"))
                    continue
                rows.append(_engine_run(cfg, params, impl, b, prompt_len, new_tokens))
        entry = {"rows": rows}
        if name == "llama3_8b":
            weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                               for x in jax.tree.leaves(params))
            b = max(batches)
            kv_bytes = b * (prompt_len + new_tokens) * cfg.kv_bytes_per_token()
            floor_ms = (weight_bytes + kv_bytes) / (ctx.peak * 1e9) * 1e3 if ctx.peak else None
            kern = [r for r in rows if r["batch"] == b and r["impl"] == ctx.impl]
            step = kern[0].get("decode_step_ms") if kern else None
            entry["roofline"] = dict(batch=b, weight_gb=weight_bytes / 1e9, kv_gb=kv_bytes / 1e9,
                                     read_once_ms=floor_ms, decode_step_ms=step,
                                     ratio=(step / floor_ms) if step and floor_ms else None,
                                     target_ratio=1.5)
        out[name] = entry
        del params
    return out


def section_acceptance(ctx: Ctx) -> dict:
    """accept_draft_tree alone vs the whole verify step at the same shapes."""
    import jax
    import jax.numpy as jnp

    from seer_jax.model.sampling_acceptance import accept_draft_tree

    S, N, V = (128, 7, 49152) if not ctx.dry else (2, 3, 256)  # SmolLM2 vocab, batch 128
    key = jax.random.key(3)
    logits = jax.random.normal(key, (S, N + 1, V), jnp.float32)
    toks = jax.random.randint(key, (S, N), 0, V, jnp.int32)
    parents = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32) - 1, (S, N))
    nd = jnp.full((S,), N, jnp.int32)
    temp, top_p = jnp.ones((S,), jnp.float32), jnp.full((S,), 0.95, jnp.float32)
    top_k = jnp.zeros((S,), jnp.int32)
    keys = jax.random.split(key, S)
    fn = jax.jit(accept_draft_tree)
    t = _timeit(fn, toks, parents, nd, logits, temp, top_p, top_k, keys, iters=ctx.iters)
    return dict(seqs=S, nodes=N, vocab=V, top_p=0.95, accept_ms=t * 1e3)


SECTIONS = {"correctness": section_correctness, "decode": section_decode,
            "prefill": section_prefill, "engine": section_engine,
            "acceptance": section_acceptance}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, kernels in interpret mode on CPU (CI)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop starting new measurements after this many seconds")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    ctx = Ctx(args.dry_run)
    from seer_jax.provenance import run_info

    info = run_info(None if argv is None else [sys.argv[0], *argv])
    report: dict = {**info, "versions": {"python": info["python"], **info["packages"]},
                    "backend": ctx.backend, "devices": [d.device_kind for d in jax.devices()],
                    "impl": ctx.impl, "interpret": ctx.interpret, "dry_run": args.dry_run}
    t_all = time.perf_counter()
    ctx.deadline = t_all + args.budget_s
    errors = {}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = SECTIONS[name](ctx)
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            errors[name] = f"{type(e).__name__}: {e}"
            report[name] = {"error": errors[name], "traceback": traceback.format_exc()[-4000:]}
        report[name]["seconds"] = time.perf_counter() - t0
        print(f"[device_check] {name}: {report[name]['seconds']:.1f} s", file=sys.stderr)
    report["summary"] = _summary(report, errors, time.perf_counter() - t_all)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report["summary"], indent=1))
    return 1 if errors else 0


def _summary(r: dict, errors: dict, seconds: float) -> dict:
    s: dict = {"seconds": seconds, "errors": errors, "backend": r["backend"], "impl": r["impl"]}
    if "cases" in r.get("correctness", {}):
        s["kernels_match_reference"] = r["correctness"]["all_ok"]
    if "rows" in r.get("decode", {}):
        s["decode_min_frac_of_peak_batch32_ctx4k"] = r["decode"]["min_frac_batch32_ctx4k"]
        s["decode_best_gbps"] = max(x["hbm_gbps"] for x in r["decode"]["rows"])
    if "rows" in r.get("prefill", {}):
        s["prefill_best_tflops"] = max(x["tflops"] for x in r["prefill"]["rows"])
    eng = r.get("engine", {})
    for name, entry in eng.items():
        if isinstance(entry, dict) and "rows" in entry:
            for row in entry["rows"]:
                if "tokens_per_s" in row:
                    s[f"engine_{name}_b{row['batch']}_{row['impl']}_tok_s"] = row["tokens_per_s"]
            if entry.get("roofline"):
                s[f"engine_{name}_decode_step_over_read_once"] = entry["roofline"]["ratio"]
    if "accept_ms" in r.get("acceptance", {}):
        acc = r["acceptance"]["accept_ms"]
        s["acceptance_ms"] = acc
        # Share of a verify step at the same batch: a verify step costs at least a decode step.
        rows = [x for x in eng.get("smollm2_135m", eng.get("tiny", {})).get("rows", [])
                if x["impl"] == r["impl"] and x.get("decode_step_ms")]
        if rows:
            step = max(rows, key=lambda x: x["batch"])["decode_step_ms"]
            s["acceptance_share_of_verify_step_upper_bound"] = acc / (acc + step)
    return s


if __name__ == "__main__":
    sys.exit(main())
