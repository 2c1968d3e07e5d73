"""The global KV pool across hosts, on Ray's object store (a `KVPool` backend).

Layout: a small directory actor keeps, per request, the handle, the object ref of the KV blob and
its size, with the byte capacity, LRU eviction and versioned handles of `HostKVPool` (it holds a
`HostKVPool` whose blobs are the refs). The blobs themselves are in the object store:

- `put` (on the engine actor whose chunk ended): `ray.put` of the blob in the typed KV blob
  format (`kv_codec`), then the ref is registered with
  the directory. The writing actor owns the object (Ray removed `ray.put(_owner=...)`), so the
  KV of a lost actor dies with it. The directory records each blob's writer (its actor id); when
  an actor is found lost, `writer_lost` drops all its blobs (counted `lost`) before anything
  reads them, so their requests re-prefill whatever the timing (Ray frees owned objects shortly
  after the owner's death: reading one in between could succeed or fail). A blob found gone
  when read (`OwnerDiedError`, a lost node) is dropped the same way and the `get` answers None;
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

from seer_jax.rollout.backends.kv_codec import decode_kv_blob, encode_kv_blob
from seer_jax.rollout.backends.kv_pool import HostKVPool, KVPoolStats

GET_TIMEOUT_S = 60.0  # a blob not fetched in this long counts as lost (re-prefill)


@dataclasses.dataclass
class RayKVPoolStats(KVPoolStats):
    transfer_s: float = 0.0  # seconds spent putting blobs into and getting them from the store

    @property
    def transfer_gbps(self) -> float | None:
        """Bytes moved through the object store per second of transfer time (GB/s)."""
        return self.bytes_moved / self.transfer_s / 1e9 if self.transfer_s > 0 else None


class PoolDirectory:
    """The directory actor's class: `HostKVPool` bookkeeping over object refs (or over the keys
    of an external store: with `collect_dropped`, every blob that leaves the pool is kept for
    `take_dropped()`, so the client frees it in the store)."""

    def __init__(self, capacity_bytes: int | None, collect_dropped: bool = False):
        self.dropped: list = []
        self.pool = HostKVPool(capacity_bytes, on_drop=self.dropped.append if collect_dropped else None)
        self.transfer_s = 0.0
        self.writers: dict[str, str | None] = {}  # request_id -> actor id of its blob's writer

    def put(self, request_id: str, refs: list, nbytes: int, seconds: float,
            writer: str | None = None, stored: bool = True) -> str:
        self.transfer_s += seconds
        self.writers[request_id] = writer
        return self.pool.put(request_id, refs, nbytes, stored)

    def request_ids(self) -> list[str]:
        return list(self.writers)

    def take_dropped(self) -> list:
        out, self.dropped[:] = list(self.dropped), []
        return out

    def writer_lost(self, writer: str) -> int:
        """Drop every blob `writer` wrote (they die with it); returns how many."""
        gone = [rid for rid, w in self.writers.items() if w == writer]
        for rid in gone:
            del self.writers[rid]
        return sum(self.pool.lose(rid) for rid in gone)

    def get(self, handle: str) -> list | None:
        return self.pool.get(handle)

    def record_get(self, seconds: float) -> None:
        self.transfer_s += seconds

    def lose_read(self, handle: str) -> None:
        self.pool.lose_read(handle)

    def delete(self, request_id: str) -> None:
        self.writers.pop(request_id, None)
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
        ref = ray.put(encode_kv_blob(blob))
        seconds = time.perf_counter() - t0
        writer = ray.get_runtime_context().get_actor_id()  # None outside an actor
        # the ref travels inside a list, so the directory keeps the ref, not the blob
        return ray.get(self.directory.put.remote(request_id, [ref], nbytes, seconds, writer))

    def get(self, handle: str) -> object | None:
        import ray

        refs = ray.get(self.directory.get.remote(handle))
        if refs is None:
            return None
        return self.fetch(handle, refs)

    def fetch(self, handle: str, refs: list, report: bool = True) -> object | None:
        """The blob of `handle`, whose directory answer `refs` was read already (by this `get`,
        or once for every host of a multi-host slice); None when it is gone. report=False: leave
        the directory alone (a follower host: its leader reports the read)."""
        import ray

        t0 = time.perf_counter()
        try:
            data = ray.get(refs[0], timeout=GET_TIMEOUT_S)
        except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError):
            # its writer (the owner) or its node is gone: count it lost, the caller re-prefills
            if report:
                ray.get(self.directory.lose_read.remote(handle))
            return None
        if report:
            self.directory.record_get.remote(time.perf_counter() - t0)
        return decode_kv_blob(data)  # KVBlobFormatError for anything but a KV blob

    def delete(self, request_id: str) -> None:
        self.directory.delete.remote(request_id)

    def writer_lost(self, writer: str) -> int:
        """The actor `writer` (its Ray actor id) is lost: drop the blobs it wrote."""
        import ray

        return ray.get(self.directory.writer_lost.remote(writer))

    def stats(self) -> RayKVPoolStats:
        import ray

        return ray.get(self.directory.stats.remote())

    def shutdown(self) -> None:
        import ray

        ray.kill(self.directory)
