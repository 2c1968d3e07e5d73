"""An engine slice spanning two processes under `jax.distributed` (tp=2, one CPU device per
process, gloo collectives on loopback) gives the same greedy tokens, logprobs and exported KV as
tp=2 in one process (reference attention, plain and speculative; the worker also takes the
Pallas impls)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.engine.distributed_worker import run_impls
from tests.subprocess_env import xla_flags_without_device_count

pytestmark = pytest.mark.slow  # two jax processes compile their own steps

IMPLS = "reference"  # add ",gpu" for the Pallas kernel (interpret) under shard_map: +~60 CPU-s
WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")
ROOT = WORKER.parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_slice_matches_one_process_tp2(tmp_path):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env["XLA_FLAGS"] = xla_flags_without_device_count()
    # a two-process executable and this process's tp=2 one can share a cache key (the key hashes
    # device kinds, not processes): the workers neither read nor write the run's cache
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / f"p{i}.json"), IMPLS,
                               str(i), "2", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        # the same workload on a tp=2 mesh of this process, while the two processes run
        expect = run_impls(IMPLS.split(","), Mesh(np.array(jax.devices()[:2]), ("tp",)))
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"
    for i in range(2):
        got = json.loads((tmp_path / f"p{i}.json").read_text())
        assert (got["processes"], got["local_devices"], got["tp"]) == (2, 1, 2)
        for impl in IMPLS.split(","):
            assert got["runs"][impl] == expect[impl], (i, impl)
    # the workload covers what crosses the host boundary: swaps, KV export, accepted drafts
    assert expect["reference"]["plain"]["preemptions"] > 0
    assert expect["reference"]["spec"]["spec_accepted"] > 0
    assert len(expect["reference"]["plain"]["tokens"]) == 5  # 2 groups x 2 samples + "x"
