"""`seer-jax check-deploy CONFIG [--compile]`: check a deployment config without its devices.

Without --compile: the mesh arithmetic and the memory budget from the model's dimensions
(`validate_config`). With --compile: the engine step a slice of the config runs (decode, mixed
prefill, verify of draft trees) compiled for the config's chip (`mesh.chip`) by that chip's own
compiler, on this host, and its per-device bytes from the compiler; a step that does not fit
the device's HBM is an error naming the config, the bytes and the chip. Compiling needs the
compiler wheels: pip install 'seer-jax[hardware]' (`make test-hardware` builds an environment
with them).
"""

from __future__ import annotations

import argparse
import json

NAME = "check-deploy"
HELP = "check a deployment config; --compile compiles its engine step for its chip"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="a deployment config file (configs/*.py)")
    p.add_argument("--compile", action="store_true",
                   help="compile the engine step for mesh.chip and check it fits, per the compiler")
    p.add_argument("--impl", default="auto", help="engine attention impl to compile "
                   "(auto = the chip's kernels, reference = the jnp reference)")
    p.add_argument("--kinds", default="decode,mixed,verify", help="step kinds to compile")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from seer_jax.config_files import load_config_file
    from seer_jax.integrations.deploy_config import validate_config
    from seer_jax.provenance import run_info

    c = load_config_file(args.config, args.config_overrides)
    summary = validate_config(c)
    steps = []
    if args.compile:
        import os

        import jax

        # compile-only: no device is used. jax read JAX_PLATFORMS when it was imported (loading
        # the config imports it), so an unset one is set through its config; with the GPU
        # compiler installed and no GPU attached, jax would otherwise fail to start CUDA
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
        from seer_jax.hardware.deploy import compile_config

        steps = compile_config(c, args.impl, tuple(k for k in args.kinds.split(",") if k))
    if args.json:
        out = {"config": c.name, "layout": summary, "steps": [s.to_dict() for s in steps],
               "summary": {"config": c.name, "valid": True, "compiled": bool(steps),
                           "fits": all(s.fits for s in steps) if steps else None,
                           "max_peak_gib": max((s.peak_bytes for s in steps), default=0) / 2**30},
               "run": run_info()}
        print(json.dumps(out, indent=1, default=str))
        return 0
    print(f"{c.name}: valid; {summary['num_instances']} instances x tp{summary['tp']}, per device "
          f"{summary['weight_gib_per_device']:.2f} GiB weights + "
          f"{summary['kv_gib_per_device']:.2f} GiB KV"
          + (" (latent rows, not split over tp)" if summary["kv_layout"] == "latent" else ""))
    for s in steps:
        print(f"  {s.kind:7s} impl={s.impl:9s} on {s.chip}: peak {s.peak_bytes / 2**30:6.2f} GiB "
              f"(arguments {s.argument_bytes / 2**30:.2f}, temporaries {s.temp_bytes / 2**30:.2f}) "
              f"of {s.budget_bytes / 2**30:.2f} GiB: fits")
    return 0
