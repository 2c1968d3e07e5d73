"""Test setup, before jax is imported: 8 fake CPU devices for sharding tests; the engine's
scatter-uniqueness check on; a persistent compilation cache that the test processes write and
the processes they start (CLI runs, Ray actors) read, so a subprocess loads the tiny model's
engine steps instead of compiling them; and one Ray cluster per test process for the modules
that need one.

The test processes (pytest and its xdist workers) never load an executable from the persistent
cache. Loading a serialized XLA:CPU executable is the one step of a run that can take the whole
worker down (a crash inside `deserialize_executable`, seen once in CI, which then left the
scheduler waiting on the dead worker's tests); a worker only loses the executables the other
worker compiled, a subprocess that crashes fails only its own test."""

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


def _write_only_compilation_cache() -> None:
    """This process writes the persistent compilation cache and never reads it."""
    from jax._src import compiler

    if not hasattr(compiler, "_cache_read"):  # a jax whose cache hooks moved: keep its default
        return
    compiler._cache_read = lambda *args, **kwargs: (None, None)


_write_only_compilation_cache()

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
