"""Where a result came from: the command, the git commit, package versions and the machine.

Every benchmark and every `--json` report carries `run_info()` under the key "run", so a number
in the docs can be traced to the code and environment that produced it.
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys
from importlib import metadata

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "ml-collections", "tokenizers", "torch",
            "transformers", "google-tunix", "ray", "triton")


def _git(*args: str, cwd: pathlib.Path) -> str:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_info(argv: list[str] | None = None) -> dict:
    """The command (`argv`, default sys.argv), commit (and whether tracked files differ from
    it), installed versions of the packages that matter, and the machine."""
    argv = list(sys.argv if argv is None else argv)
    root = pathlib.Path(__file__).resolve().parents[1]
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    devices = None
    if "jax" in sys.modules:
        import jax

        devices = sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()})
    return {
        "command": " ".join([pathlib.Path(sys.executable).name, *argv]),
        "commit": _git("rev-parse", "HEAD", cwd=root) or None,
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", cwd=root)),
        "python": platform.python_version(),
        "packages": versions,
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "cpus": os.cpu_count(), "devices": devices},
    }
