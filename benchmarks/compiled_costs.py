"""The cost model against the compiler: costs.py's roofline next to the compiled engine step's
own flops and bytes accessed, on TPU v5p and H100 (compiled on this host, no device needed).

Part 1, roofline vs compiler: decode at batch 1/32/256 x context 1K/8K/32K and one prefill
chunk, one chip, Llama-3-8B and Qwen2.5-7B shapes. Roofline time = max(bytes / HBM bandwidth,
flops / peak) for both (no derating, no overheads): costs.RooflineCostModel's step_bytes and
step_flops against the compiler's. The step is compiled with 1 and 2 layers, unrolled, and
extrapolated linearly to the model's depth (a compiled loop body counts once in
cost_analysis; the cache's layer count changes no per-layer cost).

Part 2, bytes accessed vs what a decode step must read: batch 128 at context 4K, Llama-3-8B and
Qwen2.5-7B, v5p tp4 and H100 tp1/tp2: bytes accessed per device (all layers) over weights + the
batch's KV per device, and the full-depth step's temporaries over its KV cache. Two figures: the
compiler's (as in part 1), and the bytes attributed instruction by instruction over the
optimized module of the full-depth step as the engine compiles it, its layer loop run by its
trip count (`hardware.hlo_bytes`: a fusion operand used only through slices counts at the
slices' bytes, each kernel call at its own estimate); with the instructions that move the most.
`--bytes-only` runs part 2 alone.

Mixtures of experts: `--deploy FILE[,FILE]` adds deployment configs (configs/*.py) to part 1,
named by their file, each on its own chip (`mesh.chip`) at decode batch 1/8/32/256 x context
8K (8: the engine's smallest decode bucket) and a prefill chunk of 2,048 tokens (`--deploy-only`: without the default models; `--deploy-batches` and `--deploy-prefill` pick
the points); their model config's `cost_spec()` must give the MoE/MLA `ModelSpec`
(`seer_jax.costs.spec_from_hf_config` builds one from the architecture fields). The roofline
then reads the shared weights plus the distinct experts the step's tokens hit
(`expected_distinct_experts`); each row also carries `costs_py_all_experts_s`, the roofline
with every expert read, since a grouped matmul over dynamic group sizes may be counted by the
compiler as reading all of them. The 25% agreement is checked on `ratio_compiled_over_costs_py`;
`ratio_attributed_over_costs_py` takes the bytes attributed instruction by instruction instead of
the cost analysis's (which counts a fusion's operands whole and TPU's VMEM prefetches as extra
reads and writes).
The deployment configs compile with per-layer weights: XLA:TPU copies an unrolled expert
stack's layer slices before their matmuls (0.8 GB a layer of Qwen3-30B-A3B at decode batch 256),
which the engine's layer scan does not. GPU: the expert GEMM kernel (`pallas.expert_gemm_gpu`,
prefill through `grouped_matmul.blocked_experts`, small decode batches through
`moe.sparse_experts`) counts by its estimate over the blocks uniform routing fills on average.
Where a GPU runs the blocked grouped matmul's loop instead (shapes the kernel cannot tile), the
loop's data-dependent trip count is one XLA's cost analysis counts once and the byte attribution
cannot know; the point compiles the analysis variant (`grouped_matmul.static_iterations`) whose
loop is unrolled to the iterations uniform routing fills on average (`expected_iterations`),
recorded as the row's `blocked_iterations`. A step whose trip count stays unknown has no
compiler figure: its row says so and leaves the check.

Pallas kernels count through their pl.CostEstimate: on TPU the compiler's cost_analysis reads it
from the Mosaic call; on GPU XLA's cost analysis counts a Triton call as nothing, so the kernels'
estimates recorded while tracing are added (`hardware.step.step_cost`).

    /path/to/compiler-env/bin/python benchmarks/compiled_costs.py --json benchmarks/results/compiled_costs.json
    /path/to/compiler-env/bin/python benchmarks/compiled_costs.py --bytes-only \
        --json benchmarks/results/compiled_bytes.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.costs import RooflineCostModel  # noqa: E402
from seer_jax.hardware.deploy import config_target  # noqa: E402
from seer_jax.hardware.step import StepLimits, compile_step, step_cost  # noqa: E402
from seer_jax.hardware.targets import get_target  # noqa: E402
from seer_jax.integrations.deploy_config import model_config, weight_bytes_per_device  # noqa: E402
from seer_jax.model import grouped_matmul, moe  # noqa: E402
from seer_jax.pallas.expert_gemm_gpu import BLOCK_ROWS, expert_gemm_problem  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
MODELS = {"llama-3-8b": "tpu_v6e32_llama3_8b.py", "qwen2.5-7b": "tpu_v5p64_qwen25_7b.py"}
PAGE = 64


def limits(batch: int, context: int, prefill: int = 0) -> StepLimits:
    """A step of `batch` decodes at `context` tokens each, or (prefill > 0) one prefill chunk of
    `prefill` tokens with nothing before it; the cache holds exactly the batch's pages."""
    if prefill:
        pages = -(-prefill // PAGE)
        return StepLimits(PAGE, pages, 0, prefill, 1, prefill)
    pages = -(-context // PAGE)
    return StepLimits(PAGE, batch * pages, batch, 16, 1, context)


def compiled_cost(cfg, target: str, tp: int, lim: StepLimits, kind: str, impl: str,
                  layer_weights: str = "auto") -> dict:
    """Flops and bytes accessed per device of the whole-depth step, from unrolled 1- and
    2-layer compiles."""
    c1, c2 = (step_cost(compile_step(dataclasses.replace(cfg, num_layers=n), target, tp, lim,
                                     kind, impl=impl, unroll=True, layer_weights=layer_weights))
              for n in (1, 2))
    keys = ("flops", "bytes_accessed", "bytes_attributed")
    return {k: c1[k] + (cfg.num_layers - 1) * (c2[k] - c1[k]) for k in keys}


def blocked_iterations(cfg, target: str, num_tokens: int) -> int | None:
    """The blocked grouped matmul's expected loop iterations for a step of `num_tokens` tokens
    on one device of `target` (None: the step does not run it)."""
    if (cfg.moe is None or get_target(target).platform != "gpu"
            or num_tokens <= moe.DENSE_MAX_TOKENS):
        return None
    m = cfg.moe
    if not expert_gemm_problem(cfg.hidden_size, m.expert_intermediate_size, BLOCK_ROWS):
        return None  # the Pallas expert GEMM kernel: no loop, counted by its estimate
    return grouped_matmul.expected_iterations(num_tokens, m.num_experts_per_tok, m.num_experts,
                                              m.num_experts)


def roofline_point(name, cfg, target, impl, batch, context, prefill=0,
                   layer_weights="auto") -> dict:
    spec = get_target(target).spec
    lim = limits(batch, context, prefill)
    kind = "mixed" if prefill else "decode"
    iters = blocked_iterations(cfg, target, prefill or batch)
    try:
        with (grouped_matmul.static_iterations(iters) if iters is not None
              else contextlib.nullcontext()):
            comp = compiled_cost(cfg, target, 1, lim, kind, impl, layer_weights)
    except RuntimeError as e:  # a loop of unknown trip count: no compiler figure
        comp = {"flops": None, "bytes_accessed": None, "bytes_attributed": None,
                "not_comparable": str(e)}
    roof = RooflineCostModel(cfg.cost_spec(name), spec)
    tokens = prefill or batch
    kv_read = prefill if prefill else batch * context  # KV tokens the step reads
    model = {"flops": roof.step_flops(1 if prefill else batch, tokens, kv_read),
             "bytes_accessed": roof.step_bytes(tokens, kv_read)}
    all_experts = dict(model, bytes_accessed=model["bytes_accessed"]
                       - roof.weight_bytes_read(tokens) + roof.weight_bytes_stored())
    t = lambda c, key="bytes_accessed": (
        None if c["flops"] is None else
        max(c[key] / spec.hbm_bytes_per_s, c["flops"] / spec.peak_flops))
    return {"model": name, "target": target, "impl": impl, "moe": roof.model.is_moe,
            "layer_weights": layer_weights, "blocked_iterations": iters,
            "step": f"prefill {prefill}" if prefill else f"decode b{batch} ctx{context}",
            "costs_py": model, "compiled": comp, "costs_py_s": t(model), "compiled_s": t(comp),
            "costs_py_all_experts_s": t(all_experts),
            "ratio_compiled_over_costs_py": None if t(comp) is None else t(comp) / t(model),
            # the compiler's flops with the bytes attributed instruction by instruction
            "attributed_s": t(comp, "bytes_attributed"),
            "ratio_attributed_over_costs_py": (None if t(comp) is None
                                               else t(comp, "bytes_attributed") / t(model))}


def bytes_point(name, cfg, target, tp, impl, batch=128, context=4096) -> dict:
    lim = limits(batch, context)
    comp = compiled_cost(cfg, target, tp, lim, "decode", impl)
    full = compile_step(cfg, target, tp, lim, "decode", impl=impl)
    attributed = step_cost(full)["attribution"]  # the full-depth module, its layer loop run
    weights = weight_bytes_per_device(cfg, tp)
    kv_batch = full.kv_bytes  # the cache holds exactly the batch's pages (context % PAGE == 0)
    must = weights + kv_batch
    top = [{"name": r.name, "opcode": r.opcode, "count": r.count, "bytes": r.total,
            "op_name": r.op_name} for r in attributed.top(8)]
    # traffic beyond weights + KV, by where it comes from (the JAX op of each instruction)
    layer_slices = sum(r.total for r in attributed.rows if "dynamic_index_in_dim" in r.op_name)
    sampling_filter = sum(r.total for r in attributed.rows if "/cond/branch_" in r.op_name)
    return {"model": name, "target": target, "tp": tp, "impl": impl, "batch": batch,
            "context": context, "compiled_bytes_accessed": comp["bytes_accessed"],
            "attributed_bytes_unrolled": comp["bytes_attributed"],
            "attributed_bytes": attributed.total, "weights_bytes": weights,
            "kv_batch_bytes": kv_batch, "bytes_ratio": comp["bytes_accessed"] / must,
            "attributed_ratio": attributed.total / must, "top_instructions": top,
            "layer_slice_bytes": layer_slices, "sampling_filter_bytes": sampling_filter,
            "temp_bytes": full.temp_bytes, "kv_cache_bytes": full.kv_bytes,
            "temp_over_kv": full.temp_bytes / full.kv_bytes}


def _print_row(name: str, target: str, r: dict) -> None:
    if r["compiled_s"] is None:
        got = "compiled      n/a (loop of unknown trip count)"
    else:
        got = (f"compiled {r['compiled_s'] * 1e3:8.3f} ms  x{r['ratio_compiled_over_costs_py']:.2f}"
               f"  attributed x{r['ratio_attributed_over_costs_py']:.2f}")
    print(f"{name:11s} {target:5s} {r['step']:24s} costs.py {r['costs_py_s'] * 1e3:8.3f} ms  {got}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="auto", help="engine attention impl (auto = kernels)")
    ap.add_argument("--targets", default="v5p,h100")
    ap.add_argument("--quick", action="store_true",
                    help="one model, batch 32 x 8K only; bytes at v5p tp4 only")
    ap.add_argument("--bytes-only", action="store_true",
                    help="part 2 only (bytes accessed against weights + KV)")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--deploy", default="", help="comma-separated deployment configs to add "
                    "(e.g. MoE ones), named by their file stem")
    ap.add_argument("--deploy-only", action="store_true",
                    help="the --deploy configs alone (not the default models)")
    ap.add_argument("--deploy-batches", default="1,8,32,256",
                    help="the --deploy configs' decode batches (comma-separated)")
    ap.add_argument("--deploy-prefill", type=int, default=2048,
                    help="the --deploy configs' prefill chunk (0: none)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    cfgs = {} if args.deploy_only else {
        n: model_config(load_config_file(CONFIGS / f)) for n, f in MODELS.items()}
    deploy = {}
    for f in filter(None, args.deploy.split(",")):
        c = load_config_file(f)
        deploy[pathlib.Path(f).stem] = (model_config(c), config_target(c).name)
    targets = args.targets.split(",")
    grid = [(b, c) for b in (1, 32, 256) for c in (1024, 8192, 32768)]
    if args.quick:
        cfgs, grid = dict(list(cfgs.items())[:1]), [(32, 8192)]
    if args.bytes_only:
        grid = []
    rows, ratios = [], []
    for name, (cfg, target) in deploy.items():
        if args.bytes_only:
            break
        batches = [int(b) for b in filter(None, args.deploy_batches.split(","))]
        prefill = [(1, 0, args.deploy_prefill)] if args.deploy_prefill else []
        for b, c, pre in [(b, 8192, 0) for b in batches] + prefill:
            rows.append(roofline_point(name, cfg, target, args.impl, b, c, prefill=pre,
                                       layer_weights="per_layer"))
            _print_row(name, target, rows[-1])
    for name, cfg in cfgs.items():
        for target in targets if grid else ():
            for b, c in grid:
                rows.append(roofline_point(name, cfg, target, args.impl, b, c))
                r = rows[-1]
                print(f"{name:11s} {target:5s} {r['step']:24s} costs.py {r['costs_py_s'] * 1e3:8.3f} ms"
                      f"  compiled {r['compiled_s'] * 1e3:8.3f} ms  x{r['ratio_compiled_over_costs_py']:.2f}",
                      flush=True)
            rows.append(roofline_point(name, cfg, target, args.impl, 1, 0, prefill=2048))
            r = rows[-1]
            print(f"{name:11s} {target:5s} {r['step']:24s} costs.py {r['costs_py_s'] * 1e3:8.3f} ms"
                  f"  compiled {r['compiled_s'] * 1e3:8.3f} ms  x{r['ratio_compiled_over_costs_py']:.2f}",
                  flush=True)
        for target, tp in [("v5p", 4), ("h100", 1), ("h100", 2)]:
            if target in targets and (not args.quick or (target, tp) == ("v5p", 4)):
                ratios.append(bytes_point(name, cfg, target, tp, args.impl))
                r = ratios[-1]
                print(f"{name:11s} {target:5s} tp{tp} b128 ctx4K: bytes {r['bytes_ratio']:.2f}x "
                      f"(weights + KV), attributed {r['attributed_ratio']:.2f}x (unrolled "
                      f"{r['attributed_bytes_unrolled'] / (r['weights_bytes'] + r['kv_batch_bytes']):.2f}x), "
                      f"temporaries {r['temp_over_kv']:.3f} of the KV cache; layer slices of "
                      f"the stacked weights {r['layer_slice_bytes'] / 1e9:.2f} GB, sampling "
                      f"filter {r['sampling_filter_bytes'] / 1e9:.2f} GB", flush=True)
                for t in r["top_instructions"][:5]:
                    print(f"    {t['bytes'] / 1e9:8.3f} GB  {t['count']:3d} x {t['opcode']:12s} "
                          f"{t['name']:28s} {t['op_name'][-70:]}", flush=True)
    compared = [r for r in rows if "not_comparable" not in r["compiled"]]
    off = [r for r in compared if abs(r["ratio_compiled_over_costs_py"] - 1) > 0.25]
    out = {"rows": rows, "bytes": ratios, "summary": {
        "impl": args.impl, "points": len(compared), "over_25pct": len(off),
        "not_comparable": len(rows) - len(compared),
        "ratio_range": [min((r["ratio_compiled_over_costs_py"] for r in compared), default=None),
                        max((r["ratio_compiled_over_costs_py"] for r in compared), default=None)],
        "bytes_ratio_max": max((r["bytes_ratio"] for r in ratios), default=None),
        "attributed_ratio_max": max((r["attributed_ratio"] for r in ratios), default=None),
        "temp_over_kv_max": max((r["temp_over_kv"] for r in ratios), default=None),
        "seconds": time.perf_counter() - t0}, "run": run_info()}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
