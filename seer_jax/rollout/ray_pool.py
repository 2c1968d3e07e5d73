"""The global KV pool across hosts, on Ray's object store (a `KVPool` backend).

Layout: a small directory actor keeps, per request, the handle, the object ref of the KV blob and
its size, with the byte capacity, LRU eviction and versioned handles of `HostKVPool` (it holds a
`HostKVPool` whose blobs are the refs). The blobs themselves are in the object store:

- `put` (on the engine actor whose chunk ended): `ray.put(blob)`, then the ref is registered with
  the directory. The writing actor owns the object (Ray removed `ray.put(_owner=...)`), so the
  KV of a lost actor is gone with it: a `get` of it answers None and the request re-prefills;
- `get` (on the engine actor that runs the next chunk): the directory answers with the ref (or
  None: evicted or superseded, the caller re-prefills) and the blob is fetched from the object
  store, from the writer's node to the reader's node;
- `delete` (controller, when a request finishes) drops the ref; eviction drops it too, and the
  object store frees the blob once no ref is left.

The controller only ever holds handle strings: KV never passes through its memory.
`stats()` adds the time spent in `ray.put`/`ray.get` of blobs, so the report can show the
transfer rate (`transfer_gbps`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from seer_jax.rollout.kv_pool import HostKVPool, KVPoolStats

GET_TIMEOUT_S = 60.0  # a blob not fetched in this long counts as lost (re-prefill)


@dataclasses.dataclass
class RayKVPoolStats(KVPoolStats):
    transfer_s: float = 0.0  # seconds spent putting blobs into and getting them from the store

    @property
    def transfer_gbps(self) -> float | None:
        """Bytes moved through the object store per second of transfer time (GB/s)."""
        return self.bytes_moved / self.transfer_s / 1e9 if self.transfer_s > 0 else None


class PoolDirectory:
    """The directory actor's class: `HostKVPool` bookkeeping over object refs."""

    def __init__(self, capacity_bytes: int | None):
        self.pool = HostKVPool(capacity_bytes)
        self.transfer_s = 0.0

    def put(self, request_id: str, refs: list, nbytes: int, seconds: float) -> str:
        self.transfer_s += seconds
        return self.pool.put(request_id, refs, nbytes)

    def get(self, handle: str) -> list | None:
        return self.pool.get(handle)

    def record_get(self, seconds: float) -> None:
        self.transfer_s += seconds

    def delete(self, request_id: str) -> None:
        self.pool.delete(request_id)

    def stats(self) -> RayKVPoolStats:
        base = dataclasses.asdict(self.pool.stats())
        return RayKVPoolStats(**base, transfer_s=self.transfer_s)


class RayKVPool:
    """Client of the object-store pool; picklable, so every engine actor gets a copy.

    Build with `RayKVPool.create(capacity_bytes)` once Ray is initialised."""

    def __init__(self, directory: Any):
        self.directory = directory

    @classmethod
    def create(cls, capacity_bytes: int | None = None) -> RayKVPool:
        import ray

        actor = ray.remote(num_cpus=0, max_concurrency=1)(PoolDirectory).remote(capacity_bytes)
        return cls(actor)

    def put(self, request_id: str, blob: object, nbytes: int) -> str:
        import ray

        t0 = time.perf_counter()
        ref = ray.put(blob)
        seconds = time.perf_counter() - t0
        # the ref travels inside a list, so the directory keeps the ref, not the blob
        return ray.get(self.directory.put.remote(request_id, [ref], nbytes, seconds))

    def get(self, handle: str) -> object | None:
        import ray

        refs = ray.get(self.directory.get.remote(handle))
        if refs is None:
            return None
        t0 = time.perf_counter()
        try:
            blob = ray.get(refs[0], timeout=GET_TIMEOUT_S)
        except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError):
            return None  # its writer (owner) or node is gone: re-prefill
        self.directory.record_get.remote(time.perf_counter() - t0)
        return blob

    def delete(self, request_id: str) -> None:
        self.directory.delete.remote(request_id)

    def stats(self) -> RayKVPoolStats:
        import ray

        return ray.get(self.directory.stats.remote())

    def shutdown(self) -> None:
        import ray

        ray.kill(self.directory)
