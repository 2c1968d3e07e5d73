"""A loopback Mooncake master for tests, or a skip saying why there is none (CI does not install
the `mooncake` extra)."""

from __future__ import annotations

import contextlib

import pytest


@contextlib.contextmanager
def loopback_master_or_skip():
    from seer_jax.errors import ConfigError
    from seer_jax.rollout.backends.mooncake_pool import LoopbackMaster

    try:
        master = LoopbackMaster()
    except ConfigError as e:
        pytest.skip(f"Mooncake Store is not available here: {e}")
    try:
        yield master
    finally:
        master.stop()
