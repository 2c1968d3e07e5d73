"""The global KV pool, in-process host-memory backend.

Between two chunks of a request its KV cache lives here, so the next chunk can run on any
instance without re-prefill. Blobs are opaque (a real engine stores host copies of its pages, the
simulated instance a small descriptor); the pool only knows their size in bytes.

Behaviour:
- capacity in bytes, least-recently-used eviction (a `get` counts as a use); a blob larger than the
  whole capacity is not stored (its handle reads back as None: the caller re-prefills);
- one live version per request: `put` replaces the previous blob and returns a fresh handle, so a
  stale handle never returns newer (or older) KV than it named;
- counters for what moved: bytes put, bytes read back, evictions, misses (`stats()`);
- a distributed backend whose blobs die with their writer drops them as `lost`: all of a lost
  writer's blobs at once (`lose(request_id)`), or one found gone when read (`lose_read(handle)`:
  that read counts as a miss); the next read of a dropped blob misses and the caller re-prefills.

Other backends (`RayKVPool`: Ray object store; `MooncakeKVPool`: Mooncake Store) keep this
bookkeeping over their own references and implement the same three methods of
`seer_jax.rollout.core.instance.KVPool`; `stats()` is optional (the report reads it when present).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

from seer_jax.errors import ConfigError


@dataclasses.dataclass
class KVPoolStats:
    bytes_put: int = 0
    bytes_got: int = 0
    puts: int = 0
    hits: int = 0
    misses: int = 0
    lost: int = 0  # blobs dropped because the backend lost them (with their writer, or evicted them)
    evictions: int = 0
    bytes_evicted: int = 0
    used_bytes: int = 0
    peak_used_bytes: int = 0
    entries: int = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes written to plus read from the pool (what a network pool would transfer)."""
        return self.bytes_put + self.bytes_got


class HostKVPool:
    """In-process KV pool with a byte capacity and LRU eviction. Thread-safe.

    `capacity_bytes=None` means unbounded. `on_drop(blob)`, when given, is called for every blob
    that leaves the pool (replaced, evicted, deleted, lost, or never stored): a backend whose
    blobs are keys of an external store frees them there.
    """

    def __init__(self, capacity_bytes: int | None = None,
                 on_drop: Callable[[object], None] | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ConfigError(
                f"kv_pool capacity_bytes={capacity_bytes} is invalid; allowed: >= 0 or None (unbounded)"
            )
        self.capacity_bytes = capacity_bytes
        # request_id -> (handle, blob, nbytes); order = recency (last = most recent)
        self._entries: collections.OrderedDict[str, tuple[str, object, int]] = (
            collections.OrderedDict()
        )
        self._version: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stats = KVPoolStats()
        self._on_drop = on_drop

    def put(self, request_id: str, blob: object, nbytes: int, stored: bool = True) -> str:
        """Store a request's KV (replacing an older version); returns a handle. stored=False: the
        backend could not store it (counted as a put evicted at once; the handle reads None)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            v = self._version.get(request_id, 0) + 1
            self._version[request_id] = v
            handle = f"{request_id}@{v}"
            self._drop(request_id)
            st = self._stats
            st.puts += 1
            st.bytes_put += nbytes
            if not stored or (self.capacity_bytes is not None and nbytes > self.capacity_bytes):
                st.evictions += 1
                st.bytes_evicted += nbytes
                if stored and self._on_drop is not None:
                    self._on_drop(blob)
                return handle
            self._entries[request_id] = (handle, blob, nbytes)
            st.used_bytes += nbytes
            while self.capacity_bytes is not None and st.used_bytes > self.capacity_bytes:
                victim = next(iter(self._entries))
                _, vblob, vb = self._entries.pop(victim)
                st.used_bytes -= vb
                if self._on_drop is not None:
                    self._on_drop(vblob)
                st.evictions += 1
                st.bytes_evicted += vb
            st.peak_used_bytes = max(st.peak_used_bytes, st.used_bytes)
            st.entries = len(self._entries)
            return handle

    def get(self, handle: str) -> object | None:
        request_id = handle.rsplit("@", 1)[0]
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry[0] != handle:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(request_id)
            self._stats.hits += 1
            self._stats.bytes_got += entry[2]
            return entry[1]

    def lose(self, request_id: str) -> bool:
        """Drop a request's blob because it died with its writer (counted `lost`); False when the
        pool held none."""
        with self._lock:
            return self._lose(request_id)

    def lose_read(self, handle: str) -> None:
        """The blob that `get(handle)` just answered turned out gone with its writer: that read
        counts as a miss, and the blob is dropped as lost."""
        request_id = handle.rsplit("@", 1)[0]
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry[0] != handle:
                return
            st = self._stats
            st.hits -= 1
            st.bytes_got -= entry[2]
            st.misses += 1
            self._lose(request_id)

    def delete(self, request_id: str) -> None:
        with self._lock:
            self._drop(request_id)
            self._stats.entries = len(self._entries)

    def contains(self, handle: str) -> bool:
        """True when `get(handle)` would return the blob (does not count as a use)."""
        entry = self._entries.get(handle.rsplit("@", 1)[0])
        return entry is not None and entry[0] == handle

    def stats(self) -> KVPoolStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def _lose(self, request_id: str) -> bool:
        if request_id not in self._entries:
            return False
        self._drop(request_id)
        self._stats.lost += 1
        self._stats.entries = len(self._entries)
        return True

    def _drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._stats.used_bytes -= entry[2]
            if self._on_drop is not None:
                self._on_drop(entry[1])
