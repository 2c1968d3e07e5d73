"""benchmarks/device_check.py --dry-run: every section end to end on CPU (tiny shapes, kernels in
interpret mode), so the script a GPU run depends on cannot rot."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.subprocess_env import xla_flags_without_device_count

pytestmark = pytest.mark.slow  # engines or a cluster: make test runs these, test-fast does not

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_device_check_dry_run(tmp_path):
    out = tmp_path / "device_check.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               XLA_FLAGS=f"{xla_flags_without_device_count()} "
               "--xla_force_host_platform_device_count=1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--dry-run",
                        "--out", str(out)], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    for key in ("summary", "command", "commit", "versions", "correctness", "decode", "prefill",
                "engine", "acceptance"):
        assert key in rep, key
    s = rep["summary"]
    assert s["errors"] == {} and s["kernels_match_reference"] is True
    assert s["decode_best_gbps"] > 0 and s["prefill_best_tflops"] > 0
    assert 0 < s["acceptance_share_of_verify_step_upper_bound"] < 1
    assert rep["engine"]["tiny"]["rows"][0]["tokens"] > 0
