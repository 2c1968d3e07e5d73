"""Environment for the processes tests start (CLI runs, benchmarks, Ray actors)."""

import os

# the test run's persistent compilation cache (tests/conftest.py sets them)
COMPILATION_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def xla_flags_without_device_count() -> str:
    """The test run's XLA flags (its XLA:CPU settings) less the fake-device count, for a
    subprocess that asks for its own devices."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if "xla_force_host_platform_device_count" not in f)


def compilation_cache_env() -> dict[str, str]:
    """So that a process loads the executables the run's other processes compiled."""
    return {k: os.environ[k] for k in COMPILATION_CACHE_VARS}
