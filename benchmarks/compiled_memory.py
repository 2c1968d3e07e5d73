"""Per-device memory of every shipped deployment config's engine step, from the compiler: each
step kind (decode, mixed prefill, verify of draft trees) compiled for the config's own chip at
its slice's tp, model shapes, page size, batch limits and KV cache, with abstract weights
(`seer_jax.hardware.deploy.compile_config`, what `seer-jax check-deploy CONFIG --compile` runs).
Per step: memory_analysis()'s arguments, outputs (less those aliased onto donated arguments),
temporaries and the peak, next to the weights and KV that `validate_config` counts and the
chip's HBM budget. A step the compiler refuses (out of HBM) is recorded with its error.

    /path/to/compiler-env/bin/python benchmarks/compiled_memory.py \
        --json benchmarks/results/compiled_memory.json [--impls auto,reference]
    /path/to/compiler-env/bin/python benchmarks/compiled_memory.py --configs moe --impls auto \
        --json benchmarks/results/compiled_memory_moe.json
    /path/to/compiler-env/bin/python benchmarks/compiled_memory.py --configs mla --impls auto \
        --json benchmarks/results/compiled_memory_mla.json
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
from seer_jax.errors import ConfigError  # noqa: E402
from seer_jax.hardware.deploy import compile_config  # noqa: E402
from seer_jax.hardware.step import STEP_KINDS  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
DEPLOY = ("tpu_v5p64_qwen25_7b", "tpu_v6e32_llama3_8b", "gpu_8xh200", "gpu_4x8xh100_llama31_405b")
# the mixtures of experts (run with --configs moe)
MOE = ("tpu_v5p64_qwen3_30b_a3b", "gpu_8xh100_qwen3_30b_a3b", "tpu_v5p64_qwen3_235b_a22b",
       "gpu_8xh200_qwen3_235b_a22b")
# the DeepSeek-V3 family: latent attention and a mixture of experts (run with --configs mla)
MLA = ("tpu_v6e32_moonlight_16b_a3b", "gpu_8xh100_moonlight_16b_a3b", "tpu_v5p64_kimi_k2",
       "gpu_4x8xh200_kimi_k2")
GIB = 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(DEPLOY))
    ap.add_argument("--impls", default="auto,reference")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    names = {"moe": MOE, "mla": MLA}.get(args.configs) or args.configs.split(",")
    for name in names:
        c = load_config_file(CONFIGS / f"{name}.py")
        for impl in args.impls.split(","):
            for kind in STEP_KINDS:
                try:
                    t1 = time.perf_counter()
                    (m,) = compile_config(c, impl, (kind,))
                    row = {**m.to_dict(), "compile_s": time.perf_counter() - t1}
                    print(f"{name:28s} {impl:9s} {kind:7s} peak {m.peak_bytes / GIB:7.2f} GiB "
                          f"(temporaries {m.temp_bytes / GIB:6.2f}) of {m.budget_bytes / GIB:6.2f}"
                          f" GiB: {'fits' if m.fits else 'DOES NOT FIT'}", flush=True)
                except ConfigError as e:
                    row = {"config": name, "impl": impl, "kind": kind, "fits": False,
                           "error": str(e)}
                    print(f"{name:28s} {impl:9s} {kind:7s} {e}", flush=True)
                rows.append(row)
    out = {"rows": rows, "summary": {
        "steps": len(rows), "fit": sum(bool(r["fits"]) for r in rows),
        "not_fit": [f"{r['config']} {r['impl']} {r['kind']}" for r in rows if not r["fits"]],
        "seconds": time.perf_counter() - t0}, "run": run_info()}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
