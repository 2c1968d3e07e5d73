"""Test setup, before jax is imported: 8 fake CPU devices for sharding tests; the engine's
scatter-uniqueness check on; and one Ray cluster per test process for the modules that need one.

No persistent compilation cache in the test processes or the processes they start, but for the
Ray actors (`tests.subprocess_env.compilation_cache_env`, one engine per actor process).
Serializing and loading XLA:CPU executables crashed an xdist worker twice in CI (an abort in
`executable.serialize()` and a segfault in `deserialize_executable`, each while the test's
engines ran steps on other threads), which a test process cannot survive."""

import os

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
