"""Kernel benchmark: ragged paged MLA attention (absorbed form) and the latent write per call.

Shapes are Moonlight-16B-A3B's per device at tp 1 (16 heads, kv_lora_rank 512, qk_rope_head_dim
64; Kimi-K2 at tp 4 has the same), bf16 by default, pages of 16 tokens. On any backend: the
jitted jnp reference. On a GPU additionally the Pallas GPU kernels, on a TPU the Pallas TPU
kernels, with achieved latent-cache bandwidth (bytes of latent rows the queries need / time) for
kernel and reference on the same device. Prints a table; --json writes rows, a `summary` and
the `run` block.

  python benchmarks/mla_kernels.py [--quick] [--json out.json]
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

from seer_jax.pallas.mla import ragged_paged_mla_attention
from seer_jax.pallas.mla_testing import make_mla_batch
from seer_jax.pallas.mla_write import write_latent
from seer_jax.provenance import run_info

SHAPE = dict(num_heads=16, kv_lora_rank=512, rope_dim=64)
SCALE = 192 ** -0.5


def _shapes(quick: bool):
    b = 4 if quick else 64
    kv = 256 if quick else 4096
    tree = [-1, 0, 1, 2, 3, 0, 5, 6, 1]  # 9 verify tokens: two branches
    return {
        "decode": dict(seqs=[(1, kv)] * b, max_q_len=1, trees=None),
        "prefill": dict(seqs=[(64 if quick else 512, kv // 2)] * 2, max_q_len=None, trees=None),
        "verify": dict(seqs=[(9, kv)] * (b // 2), max_q_len=9,
                       trees={i: tree for i in range(b // 2)}),
        "mixed": dict(seqs=[(1, kv)] * (b // 2) + [(9, kv)] * 2 + [(64 if quick else 128, 256)],
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


def bench_attention(quick: bool, iters: int, dtype, kernel: str | None) -> list[dict]:
    rows = []
    for name, cfg in _shapes(quick).items():
        seqs = cfg["seqs"]
        b = make_mla_batch(seqs, page_size=16, max_seqs=len(seqs) + 4,
                           num_tokens=sum(q for q, _ in seqs) + 8, trees=cfg["trees"],
                           dtype=dtype, **SHAPE)
        b.latent_pages = np.nan_to_num(b.latent_pages)  # timing only
        args = [jnp.asarray(a) for a in b.args()]
        tree = None if b.tree_parents is None else jnp.asarray(b.tree_parents)
        n = int(b.num_seqs)
        nbytes = int(b.kv_lens[:n].sum()) * b.latent_pages.shape[-1] * args[2].dtype.itemsize
        impls = [("reference", {"max_q_len": cfg["max_q_len"]})] + (
            [(kernel, {})] if kernel else [])
        for impl, kw in impls:
            fn = jax.jit(lambda *a, impl=impl, kw=kw, tree=tree: ragged_paged_mla_attention(
                *a, sm_scale=SCALE, tree_parents=tree, impl=impl, **kw))
            t = _time(fn, *args, iters=iters)
            rows.append(dict(kernel="mla_attention", shape=name, impl=impl,
                             num_seqs=n, num_tokens=int(b.cu_q_lens[n]),
                             kv_tokens=int(b.kv_lens.sum()), ms_per_call=t * 1e3,
                             kv_gb_per_s=nbytes / t / 1e9))
    return rows


def bench_write(quick: bool, iters: int, dtype, kernel: str | None) -> list[dict]:
    rows = []
    pages = 512 if quick else 8192
    n_new = 64 if quick else 256
    rng = np.random.default_rng(0)
    new_c = jnp.asarray(rng.normal(size=(n_new, 512)), dtype)
    new_r = jnp.asarray(rng.normal(size=(n_new, 64)), dtype)
    slots = jnp.asarray(rng.permutation(pages * 16)[:n_new], jnp.int32)  # decode-like scatter
    for impl in ["reference"] + ([kernel] if kernel else []):
        fn = jax.jit(lambda c, a, r, s, impl=impl: write_latent(c, a, r, s, impl=impl),
                     donate_argnums=0)
        state = [jnp.zeros((pages, 16, 576), dtype)]

        def step(fn=fn, state=state):
            state[0] = fn(state[0], new_c, new_r, slots)
            return state[0]

        jax.block_until_ready(step())
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            ts.append(time.perf_counter() - t0)
        rows.append(dict(kernel="write_latent", shape=f"{n_new} scattered tokens", impl=impl,
                         ms_per_call=statistics.median(ts) * 1e3))
    return rows


def summarize(rows: list[dict]) -> dict:
    out = {"backend": jax.default_backend(), "devices": str(jax.devices()[0].device_kind)}
    by = {(r["kernel"], r["shape"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] != "reference":
            continue
        key = f"{r['kernel']}_{r['shape'].split()[0]}"
        out[f"{key}_reference_ms"] = round(r["ms_per_call"], 3)
        for kern in ("gpu", "tpu"):
            kr = by.get((r["kernel"], r["shape"], kern))
            if kr:
                out[f"{key}_{kern}_ms"] = round(kr["ms_per_call"], 3)
                out[f"{key}_{kern}_speedup_vs_reference"] = round(
                    r["ms_per_call"] / kr["ms_per_call"], 3)
                if "kv_gb_per_s" in kr:
                    out[f"{key}_{kern}_kv_gb_per_s"] = round(kr["kv_gb_per_s"], 2)
    out["kernel_ran"] = any(r["impl"] in ("gpu", "tpu") for r in rows)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes (CI / smoke)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--json", help="write rows + summary to this file")
    a = p.parse_args(argv)
    dtype = jnp.bfloat16 if a.dtype == "bfloat16" else np.float32
    kernel = {"gpu": "gpu", "cuda": "gpu", "tpu": "tpu"}.get(jax.default_backend())
    rows = (bench_attention(a.quick, a.iters, dtype, kernel)
            + bench_write(a.quick, a.iters, dtype, kernel))
    hdr = f"{'kernel':14} {'shape':22} {'impl':10} {'ms/call':>9} {'KV GB/s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        bw = f"{r['kv_gb_per_s']:9.2f}" if "kv_gb_per_s" in r else " " * 9
        print(f"{r['kernel']:14} {r['shape']:22} {r['impl']:10} {r['ms_per_call']:9.3f} {bw}")
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "rows": rows, "args": vars(a), "run": run_info()}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
