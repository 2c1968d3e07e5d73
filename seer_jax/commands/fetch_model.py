"""`seer-jax fetch-model smollm2`: put a known model into the cache, verified; print its path."""

from __future__ import annotations

import argparse
import json

from seer_jax.errors import SeerError
from seer_jax.model import hub

NAME = "fetch-model"
HELP = "download a known model (smollm2) into the cache ($SEER_JAX_CACHE) and print its path"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"model name, one of: {', '.join(sorted(hub.KNOWN_MODELS))}")
    p.add_argument("--force", action="store_true", help="download and extract again even if present")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of the path")


def run(args: argparse.Namespace) -> int:
    from seer_jax.provenance import run_info

    spec = hub.KNOWN_MODELS.get(args.model)
    if spec is None:
        raise SeerError(
            f"unknown model {args.model!r}; known: {', '.join(sorted(hub.KNOWN_MODELS))} "
            "(other models are used from a local path, no fetch needed)"
        )
    already = not args.force and hub.is_valid(hub.model_file(spec), spec)
    path = hub.fetch_model(spec, force=args.force)
    if args.json:
        size = path.stat().st_size
        out = {
            "model": spec.name,
            "path": str(path),
            "sha256": spec.sha256,
            "bytes": size,
            "summary": {"model": spec.name, "bytes": size, "downloaded": not already},
            "run": run_info(),
        }
        print(json.dumps(out))
    else:
        print(path)
    return 0
