"""XLA flags for the subprocesses tests start (CLI runs, benchmarks)."""

import os


def xla_flags_without_device_count() -> str:
    """The test run's XLA flags (its XLA:CPU settings) less the fake-device count, for a
    subprocess that asks for its own devices."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if "xla_force_host_platform_device_count" not in f)
