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


def text_blob(text: str):
    """A KV blob standing for `text` (the stores hold typed KV blobs only)."""
    import numpy as np

    from seer_jax.engine.engine import KVBlob

    return KVBlob([ord(c) for c in text], [], np.zeros((1, 1, 0, 1), np.float32),
                  np.zeros((1, 1, 0, 1), np.float32))


class TextBlobs:
    """A KV pool that takes and returns strings, stored as `text_blob`s in `pool`."""

    def __init__(self, pool):
        self.pool = pool

    def put(self, request_id, text, nbytes):
        return self.pool.put(request_id, text_blob(text), nbytes)

    def get(self, handle):
        blob = self.pool.get(handle)
        return None if blob is None else "".join(map(chr, blob.prompt_ids))

    def __getattr__(self, name):
        return getattr(self.pool, name)
