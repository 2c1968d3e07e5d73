"""Test setup, before jax is imported: 8 fake CPU devices for sharding tests; the engine's
scatter-uniqueness check on; a persistent
compilation cache shared by every process of a run (xdist workers, Ray actors, CLI
subprocesses), so an executable the modules share (the tiny model's engine steps, the kernels)
compiles once; and one Ray cluster per test process for the modules that need one."""

import os
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"seer_jax_tests_jax_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# every scatter the engine sends is checked for repeated indices (whose order TPUs and GPUs
# leave unspecified); inherited by the processes the tests start
os.environ.setdefault("SEER_CHECK_SCATTERS", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

@pytest.fixture(scope="session")
def ray_cluster():
    """A local loopback Ray cluster, started once per test process and shut down at its end:
    Ray is never initialised again in a process that shut it down. The modules that use it are
    marked `xdist_group("ray")`, so that under `--dist loadgroup` (`make test`) they share one
    worker and one cluster."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'seer-jax[ray]')")
    from seer_jax.rollout.backends.ray_cluster import RayBackendConfig, ensure_ray

    ensure_ray(RayBackendConfig(object_store_mb=200, num_cpus=8))
    yield ray
    ray.shutdown()
