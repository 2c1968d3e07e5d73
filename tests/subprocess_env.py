"""Environment for the processes tests start (CLI runs, benchmarks, Ray actors)."""

import os
import tempfile


def xla_flags_without_device_count() -> str:
    """The test run's XLA flags (its XLA:CPU settings) less the fake-device count, for a
    subprocess that asks for its own devices."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if "xla_force_host_platform_device_count" not in f)


def compilation_cache_env() -> dict[str, str]:
    """A persistent compilation cache the Ray actors of a test run share (each actor process
    runs one engine), so that an actor loads the steps another compiled."""
    path = os.path.join(tempfile.gettempdir(), f"seer_jax_tests_jax_cache_{os.getuid()}")
    return {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
