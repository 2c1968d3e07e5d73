"""Bytes a mixture-of-experts decode step accesses against what it must read, per the compiler:
the MoE deployment configs' models at their slices (Qwen3-30B-A3B on v5p tp4 and H100 tp2,
Qwen3-235B-A22B on v5p tp16 and H200 tp8; with --models moonlight-16b-a3b,kimi-k2 the
DeepSeek-V3 family's: Moonlight-16B-A3B on v6e tp4 and H100 tp2, Kimi-K2 on v5p tp32 and H200
tp32), batch 128 at context 4K, all layers, compiled as the engine compiles the step (experts
split over tp, attention tensor-parallel on the same devices; a latent-attention model's cache
whole on every device, as each device's heads read all of it).

"Must read" per device: every weight except the routed experts, of which those the batch is
expected to hit, E * (1 - (1 - k/E)^B) of each layer's E (`weight_bytes_read_per_device`), plus
the batch's KV. "Attributed": `hardware.hlo_bytes` over the optimized module of the full-depth
step (each instruction's operands and result, a kernel call at its cost estimate, the layer loop
run by its trip count). The expert projections' instructions are summed apart (their op names
carry the `dense_experts` einsums or `ragged_dot`), against the local experts' weight bytes.

    /path/to/compiler-env/bin/python benchmarks/compiled_moe_bytes.py \
        --json benchmarks/results/compiled_moe_bytes.json
    /path/to/compiler-env/bin/python benchmarks/compiled_moe_bytes.py \
        --models moonlight-16b-a3b,kimi-k2 --json benchmarks/results/compiled_mla_bytes.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.hardware.step import StepLimits, compile_step, step_cost  # noqa: E402
from seer_jax.integrations.deploy_config import (  # noqa: E402
    model_config,
    weight_bytes_per_device,
    weight_bytes_read_per_device,
)
from seer_jax.provenance import run_info  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
POINTS = [("qwen3-30b-a3b", "tpu_v5p64_qwen3_30b_a3b", "v5p", 4),
          ("qwen3-30b-a3b", "gpu_8xh100_qwen3_30b_a3b", "h100", 2),
          ("qwen3-235b-a22b", "tpu_v5p64_qwen3_235b_a22b", "v5p", 16),
          ("qwen3-235b-a22b", "gpu_8xh200_qwen3_235b_a22b", "h200", 8),
          # the DeepSeek-V3 family: latent attention, sigmoid routing, shared experts
          ("moonlight-16b-a3b", "tpu_v6e32_moonlight_16b_a3b", "v6e", 4),
          ("moonlight-16b-a3b", "gpu_8xh100_moonlight_16b_a3b", "h100", 2),
          ("kimi-k2", "tpu_v5p64_kimi_k2", "v5p", 32),
          ("kimi-k2", "gpu_4x8xh200_kimi_k2", "h200", 32)]
# Kimi-K2 at v5p tp32 holds 61.7 GiB of weights per chip: the latent cache of 128 sequences of 4K
# tokens (33.5 GiB; 37.2 in HBM, whose tiles pad its rows) does not fit beside them in the
# chip's 95.7 GiB (the compiler refuses it); of 3K tokens it does
CONTEXT = {"tpu_v5p64_kimi_k2": 3072}
EXPERT_OPS = ("nd,edf->enf", "enf,efd->nd", "ragged_dot")
PAGE = 64


def point(model: str, config: str, target: str, tp: int, batch: int, context: int) -> dict:
    cfg = model_config(load_config_file(CONFIGS / f"{config}.py"))
    lim = StepLimits(PAGE, batch * context // PAGE, batch, 16, 1, context)
    t0 = time.perf_counter()
    step = compile_step(cfg, target, tp, lim, "decode")
    compile_s = time.perf_counter() - t0
    attributed = step_cost(step)["attribution"]
    weights_read = weight_bytes_read_per_device(cfg, tp, batch)
    m = cfg.moe
    ep = tp if m.num_experts % tp == 0 else 1
    experts = cfg.num_moe_layers * m.num_experts // ep * 3 * cfg.hidden_size * \
        m.expert_intermediate_size * 2
    expert_ops = sum(r.total for r in attributed.rows if any(o in r.op_name for o in EXPERT_OPS))
    must = weights_read + step.kv_bytes
    return {"model": model, "config": config, "target": target, "tp": tp, "batch": batch,
            "context": context, "weights_bytes": weight_bytes_per_device(cfg, tp),
            "weights_read_bytes": weights_read, "expert_weight_bytes": experts,
            "kv_batch_bytes": step.kv_bytes, "attributed_bytes": attributed.total,
            "attributed_ratio": attributed.total / must, "expert_op_bytes": expert_ops,
            "expert_op_ratio": expert_ops / experts,
            "sampling_filter_bytes": sum(r.total for r in attributed.rows
                                         if "/cond/branch_" in r.op_name),
            "temp_bytes": step.temp_bytes, "temp_over_kv": step.temp_bytes / step.kv_bytes,
            "compile_s": compile_s,
            "top_instructions": [{"name": r.name, "opcode": r.opcode, "count": r.count,
                                  "bytes": r.total, "op_name": r.op_name}
                                 for r in attributed.top(8)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,qwen3-235b-a22b")
    ap.add_argument("--targets", default="v5p,v6e,h100,h200")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for model, config, target, tp in POINTS:
        if target not in args.targets.split(",") or model not in args.models.split(","):
            continue
        r = point(model, config, target, tp, 128, CONTEXT.get(config, 4096))
        rows.append(r)
        print(f"{model:17s} {target:5s} tp{tp:<3d} context {r['context']:5d} weights read {r['weights_read_bytes'] / 1e9:6.2f}"
              f" GB + KV {r['kv_batch_bytes'] / 1e9:6.2f} GB; attributed "
              f"{r['attributed_bytes'] / 1e9:6.2f} GB = {r['attributed_ratio']:.3f}x; expert ops "
              f"{r['expert_op_ratio']:.3f}x the local experts' weights; temporaries "
              f"{r['temp_over_kv']:.4f} of the KV", flush=True)
    out = {"rows": rows, "summary": {
        "points": len(rows),
        "attributed_ratio_max": max((r["attributed_ratio"] for r in rows), default=None),
        "expert_op_ratio_max": max((r["expert_op_ratio"] for r in rows), default=None),
        "temp_over_kv_max": max((r["temp_over_kv"] for r in rows), default=None),
        "seconds": time.perf_counter() - t0}, "run": run_info()}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
