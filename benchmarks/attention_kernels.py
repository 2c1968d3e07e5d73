"""Kernel benchmark: ragged paged attention per call (decode / prefill / verify shapes).

On any backend: the jitted jnp reference (the CPU engine's path). On a GPU additionally the
Pallas GPU kernel, on a TPU the Pallas TPU kernel, with achieved K/V bandwidth (bytes of K/V the
queries need / time) for kernel and reference on the same device. Prints a table; --json writes
rows plus a `summary` object.

  python benchmarks/attention_kernels.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from seer_jax.model.sampling_acceptance import accept_draft_tree
from seer_jax.pallas import ragged_paged_attention, write_kv
from seer_jax.pallas.testing import make_batch
from seer_jax.provenance import run_info

# SmolLM2-135M attention: 9 query heads on 3 KV heads, head_dim 64.
HEADS = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)


def _shapes(quick: bool):
    b = 8 if quick else 32
    kv = 512 if quick else 2048
    tree = [-1, 0, 1, 2, 3, 0, 5, 6, 1]  # 9 verify tokens: two branches
    return {
        "decode": dict(seqs=[(1, kv)] * b, max_q_len=1, trees=None),
        "prefill": dict(seqs=[(256 if quick else 512, kv // 2)] * 2, max_q_len=None, trees=None),
        "verify": dict(seqs=[(9, kv)] * (b // 2), max_q_len=9,
                       trees={i: tree for i in range(b // 2)}),
        "mixed": dict(seqs=[(1, kv)] * (b // 2) + [(9, kv)] * 2 + [(128, 256)],
                      max_q_len=None, trees={b // 2: tree}),
    }


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _kv_bytes(batch) -> int:
    """Bytes of K and V the queries must read (each live sequence's kv_len, all KV heads)."""
    _, _, combined, d = batch.kv_pages.shape  # combined = 2 * Hkv (K and V)
    n = int(batch.num_seqs)
    return int(batch.kv_lens[:n].sum()) * combined * d * batch.kv_pages.dtype.itemsize


def bench_attention(quick: bool, iters: int, dtype) -> list[dict]:
    backend = jax.default_backend()
    kernel = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}.get(backend)
    rows = []
    for name, cfg in _shapes(quick).items():
        seqs = cfg["seqs"]
        b = make_batch(seqs, page_size=16, max_seqs=len(seqs) + 4,
                       num_tokens=sum(q for q, _ in seqs) + 8, trees=cfg["trees"],
                       dtype=dtype, **HEADS)
        b.kv_pages = np.nan_to_num(b.kv_pages)  # timing only; NaN pages are for correctness tests
        args = [jnp.asarray(a) for a in b.args()]
        tree = None if b.tree_parents is None else jnp.asarray(b.tree_parents)
        nbytes = _kv_bytes(b)
        impls = [("reference", {}), ("reference_max_q", {"max_q_len": cfg["max_q_len"]})]
        if cfg["max_q_len"] is None:
            impls = impls[:1]
        if kernel:
            impls.append((kernel, {}))
        for label, kw in impls:
            impl = "reference" if label.startswith("reference") else label
            fn = jax.jit(lambda *a, impl=impl, kw=kw, tree=tree: ragged_paged_attention(
                *a, tree_parents=tree, impl=impl, **kw))
            t = _time(fn, *args, iters=iters)
            rows.append(dict(
                kernel="ragged_paged_attention", shape=name, impl=label, backend=backend,
                num_seqs=len(seqs), num_tokens=int(b.cu_q_lens[len(seqs)]),
                kv_tokens=int(b.kv_lens.sum()), ms_per_call=t * 1e3,
                kv_gb_per_s=nbytes / t / 1e9,
            ))
    return rows


def bench_other(quick: bool, iters: int) -> list[dict]:
    backend = jax.default_backend()
    rows = []
    hkv, d, pages, ps = 3, 64, 512 if quick else 4096, 16
    kv = jnp.zeros((pages, ps, 2 * hkv, d), jnp.float32)  # combined K/V cache
    n_new = 32
    new = jnp.ones((n_new, hkv, d), jnp.float32)
    slots = jnp.arange(n_new, dtype=jnp.int32) * 7
    fn = jax.jit(lambda kv, a, b, s: write_kv(kv, a, b, s, impl="reference"), donate_argnums=0)
    state = [kv]

    def step():
        state[0] = fn(state[0], new, new, slots)
        return state[0]

    jax.block_until_ready(step())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step())
        ts.append(time.perf_counter() - t0)
    rows.append(dict(kernel="write_kv", shape=f"{n_new} tokens, donated cache", impl="reference",
                     backend=backend, ms_per_call=statistics.median(ts) * 1e3))
    s, n, vocab = (8, 8, 49152)
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(s, n + 1, vocab)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, vocab, size=(s, n)), jnp.int32)
    par = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (s, n))
    keys = jax.random.split(jax.random.key(0), s)
    acc = jax.jit(accept_draft_tree)
    t = _time(acc, toks, par, jnp.full((s,), n, jnp.int32), logits, jnp.full((s,), 0.8),
              jnp.full((s,), 0.95), jnp.full((s,), 50, jnp.int32), keys, iters=iters)
    rows.append(dict(kernel="accept_draft_tree", shape=f"{s} seqs x {n} nodes, vocab {vocab}",
                     impl="reference", backend=backend, ms_per_call=t * 1e3))
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {"backend": jax.default_backend(), "devices": str(jax.devices()[0].device_kind)}
    by = {(r["kernel"], r["shape"], r["impl"]): r for r in rows}
    for r in rows:
        if r["kernel"] == "ragged_paged_attention" and r["impl"] == "reference":
            out[f"{r['shape']}_reference_ms"] = round(r["ms_per_call"], 3)
            fast = by.get((r["kernel"], r["shape"], "reference_max_q"))
            if fast:
                out[f"{r['shape']}_reference_max_q_ms"] = round(fast["ms_per_call"], 3)
            for kern in ("gpu", "tpu"):
                kr = by.get((r["kernel"], r["shape"], kern))
                if kr:
                    out[f"{r['shape']}_{kern}_kernel_kv_gb_per_s"] = round(kr["kv_gb_per_s"], 2)
                    out[f"{r['shape']}_reference_kv_gb_per_s"] = round(r["kv_gb_per_s"], 2)
                    out[f"{r['shape']}_kv_gb_per_s_ratio_vs_reference"] = round(
                        kr["kv_gb_per_s"] / r["kv_gb_per_s"], 3)
    for r in rows:
        if r["kernel"] != "ragged_paged_attention":
            out[f"{r['kernel']}_ms"] = round(r["ms_per_call"], 3)
    out["kernel_ran"] = any(r["impl"] in ("gpu", "tpu") for r in rows)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (CI / smoke)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="write rows + summary to this file")
    a = p.parse_args(argv)
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else np.float32
    rows = bench_attention(a.quick, a.iters, dtype) + bench_other(a.quick, a.iters)
    hdr = f"{'kernel':24} {'shape':34} {'impl':16} {'ms/call':>9} {'KV GB/s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        bw = f"{r['kv_gb_per_s']:9.2f}" if "kv_gb_per_s" in r else " " * 9
        print(f"{r['kernel']:24} {r['shape']:34} {r['impl']:16} {r['ms_per_call']:9.3f} {bw}")
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rows": rows, "args": vars(a), "run": run_info()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
