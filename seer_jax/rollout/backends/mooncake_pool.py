"""The global KV pool on Mooncake Store (a `KVPool` backend; `pip install 'seer-jax[mooncake]'`).

Mooncake Store is a distributed in-memory object store: a master (`mooncake_master`) keeps the
objects' metadata, every client mounts a segment of its host memory that holds replicas, and
objects move between hosts over TCP (or RDMA). The layout is the one of `RayKVPool`:

- a directory (`PoolDirectory`: `HostKVPool` bookkeeping with the byte capacity, LRU eviction,
  one live version per request and versioned handles) in this process, or, with `shared=True`,
  a Ray actor that every engine actor's copy of the pool talks to;
- the blobs in the store, under keys unique per pool, request, writing process and put
  (`seer/<pool>/<request>/<writer>/<n>`): a Mooncake key is written once (a second put of it
  keeps the first value), and a dead writer's keys stay visible until their lease times out,
  so a key is never reused;
- `put`: encode the blob in the typed KV blob format (`kv_codec`: a header with dtypes and
  shapes, then raw array bytes; nothing read from the store is ever unpickled), `store.put`
  with the replica preferred in the writer's own segment (the KV stays on the host that made
  it until a reader pulls it, as in the Ray pool; the store places it elsewhere only when that
  segment is full), register the key with the directory. A put the store refuses (full)
  counts as evicted at once, and its handle reads None;
- `get`: the directory answers the key (None: evicted or superseded), then `store.get`. An empty
  answer (the store evicted the object itself, or its replica was on a client that is gone)
  drops the entry as `lost` and answers None; either way the caller re-prefills;
- blobs that leave the directory (replaced, evicted, deleted, lost) are removed from the store
  by the client call that dropped them.

Each process opens one store client per `MooncakeConfig` on first use and keeps it for every
pool of that config (the pool object pickles without it; `close_clients()` closes them); the
client mounts `segment_mb` of the process's memory into the store. `stats()` counts bytes moved and the time spent
in the store, as `RayKVPool` does (`transfer_gbps`). `LoopbackMaster` starts a master on
127.0.0.1 for a dev box, tests and benchmarks.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from seer_jax.errors import ConfigError, SeerError
from seer_jax.rollout.backends.kv_codec import decode_kv_blob, encode_kv_blob
from seer_jax.rollout.backends.ray_pool import PoolDirectory, RayKVPoolStats

INSTALL_HINT = ("pip install 'seer-jax[mooncake]' and the Debian libraries libibverbs1 "
                "libnl-3-200 libnl-route-3-200 libcurl4 libnuma1")


def require_mooncake() -> Any:
    """The `MooncakeDistributedStore` class, or a ConfigError saying how to get it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as e:  # OSError: a shared library of the wheel is missing
        raise ConfigError(
            f"kv_pool='mooncake' needs Mooncake Store, which cannot be loaded ({e}); "
            f"allowed: {INSTALL_HINT}, or kv_pool='host' / 'ray'") from None
    return MooncakeDistributedStore


@dataclasses.dataclass(frozen=True)
class MooncakeConfig:
    """How a process reaches the store.

    master: "host:port" of the master's RPC service. metadata_server: the transfer engine's
    metadata service ("http://host:port/metadata", the master's own with
    `--enable_http_metadata_server`). local_hostname: the address other clients reach this
    one at. protocol: "tcp" or "rdma" (then rdma_devices). segment_mb: host memory this client
    adds to the store; buffer_mb: its transfer buffer.
    """

    master: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    rdma_devices: str = ""
    segment_mb: int = 256
    buffer_mb: int = 128

    def validate(self) -> MooncakeConfig:
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"mooncake_master={self.master!r} is invalid; allowed: 'host:port'")
        if not self.metadata_server.startswith(("http://", "etcd://", "redis://")):
            raise ConfigError(f"mooncake_metadata_server={self.metadata_server!r} is invalid; "
                              "allowed: 'http://host:port/metadata' (or an etcd:// / redis:// URL)")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol={self.protocol!r} is invalid; allowed: tcp, rdma")
        for key in ("segment_mb", "buffer_mb"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"mooncake_{key}={v!r} is invalid; allowed: an integer >= 1")
        return self


class MooncakeKVPool:
    """KV pool with its blobs in Mooncake Store; see the module docstring. Thread-safe."""

    def __init__(self, config: MooncakeConfig, capacity_bytes: int | None = None,
                 directory: Any = None):
        self.config = config.validate()
        self.directory = directory if directory is not None else PoolDirectory(
            capacity_bytes, collect_dropped=True)
        self.pool_id = uuid.uuid4().hex[:12]
        self._init_process()

    @classmethod
    def create(cls, config: MooncakeConfig, capacity_bytes: int | None = None,
               shared: bool = False) -> MooncakeKVPool:
        """shared=True: the directory is a Ray actor, so the pool can be handed to engine
        actors (Ray must be initialised)."""
        directory = None
        if shared:
            import ray

            directory = ray.remote(num_cpus=0, max_concurrency=1)(PoolDirectory).remote(
                capacity_bytes, True)
        return cls(config, capacity_bytes, directory)

    # ---- pickling: a process opens its own client ----------------------------------------------
    def _init_process(self) -> None:
        self._store: Any = None
        self._lock = threading.Lock()
        self._writer_tag = uuid.uuid4().hex[:8]
        self._seq = itertools.count()

    def __getstate__(self) -> dict:
        return {"config": self.config, "directory": self.directory, "pool_id": self.pool_id}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_process()

    def _client(self) -> Any:
        if self._store is None:
            self._store = _client(self.config)
        return self._store

    def _call(self, method: str, *args: Any) -> Any:
        if isinstance(self.directory, PoolDirectory):
            return getattr(self.directory, method)(*args)
        import ray

        return ray.get(getattr(self.directory, method).remote(*args))

    # ---- KVPool ----------------------------------------------------------------------------------
    def put(self, request_id: str, blob: object, nbytes: int) -> str:
        with self._lock:
            store = self._client()
            key = f"seer/{self.pool_id}/{request_id}/{self._writer_tag}/{next(self._seq)}"
            t0 = time.perf_counter()
            rc = store.put(key, encode_kv_blob(blob), _local_replica(store))
            seconds = time.perf_counter() - t0
            handle = self._call("put", request_id, [key], nbytes, seconds, _writer(), rc == 0)
            self._free()
            return handle

    def get(self, handle: str) -> object | None:
        with self._lock:
            keys = self._call("get", handle)
        if keys is None:
            return None
        return self.fetch(handle, keys)

    def fetch(self, handle: str, keys: list, report: bool = True) -> object | None:
        """The blob of `handle`, whose directory answer `keys` was read already (by this `get`,
        or once for every host of a multi-host slice); None when it is gone. report=False: leave
        the directory alone (a follower host: its leader reports the read)."""
        with self._lock:
            t0 = time.perf_counter()
            data = self._client().get(keys[0])
            if not data:  # evicted by the store, or its replica went with its client
                if report:
                    self._call("lose_read", handle)
                    self._free()
                return None
            blob = decode_kv_blob(data)  # KVBlobFormatError for anything but a KV blob
            if report:
                self._call("record_get", time.perf_counter() - t0)
            return blob

    def delete(self, request_id: str) -> None:
        with self._lock:
            self._call("delete", request_id)
            self._free()

    def writer_lost(self, writer: str) -> int:
        """The Ray actor `writer` is lost: drop the blobs it wrote."""
        with self._lock:
            n = self._call("writer_lost", writer)
            self._free()
            return n

    def stats(self) -> RayKVPoolStats:
        return self._call("stats")

    def shutdown(self) -> None:
        """Remove this pool's remaining blobs from the store (the process's client stays open
        for other pools: `close_clients()`)."""
        with self._lock:
            for rid in list(self._call("request_ids")):
                self._call("delete", rid)
            self._free()
        if not isinstance(self.directory, PoolDirectory):
            import ray

            ray.kill(self.directory)

    def _free(self) -> None:
        """Remove the blobs the directory dropped from the store (their readers are gone: a
        lease would only delay it)."""
        dropped = self._call("take_dropped")
        if dropped:
            store = self._client()
            for keys in dropped:
                store.remove(keys[0], True)


_CLIENTS: dict[MooncakeConfig, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(c: MooncakeConfig) -> Any:
    """This process's store client for `c` (set up on first use)."""
    with _CLIENTS_LOCK:
        store = _CLIENTS.get(c)
        if store is None:
            store_cls = require_mooncake()
            if c.protocol == "tcp":  # the transfer engine binds this address, not the NIC's
                os.environ.setdefault("MC_TCP_BIND_ADDRESS", c.local_hostname)
            store = store_cls()
            rc = store.setup(c.local_hostname, c.metadata_server, c.segment_mb << 20,
                             c.buffer_mb << 20, c.protocol, c.rdma_devices, c.master)
            if rc != 0:
                raise SeerError(f"Mooncake Store client setup failed (code {rc}): master "
                                f"{c.master}, metadata server {c.metadata_server}")
            _CLIENTS[c] = store
        return store


def _local_replica(store: Any) -> Any:
    """A put's replica config: one replica, preferably in this client's own segment."""
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segment = store.get_hostname()
    return config


def close_clients() -> None:
    """Close this process's store clients (their segments leave the store)."""
    with _CLIENTS_LOCK:
        for store in _CLIENTS.values():
            store.close()
        _CLIENTS.clear()


def _writer() -> str | None:
    """The Ray actor id of this process, None outside an actor."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_actor_id()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackMaster:
    """A `mooncake_master` on 127.0.0.1 with its HTTP metadata server, on free ports (a context
    manager; `config` is what clients use). For a dev box, tests and benchmarks."""

    def __init__(self, log_path: str | None = None, start_timeout_s: float = 20.0):
        require_mooncake()
        exe = shutil.which("mooncake_master") or os.path.join(
            os.path.dirname(sys.executable), "mooncake_master")
        if not os.path.exists(exe):
            raise ConfigError(f"mooncake_master is not installed; allowed: {INSTALL_HINT}")
        self.rpc_port, http_port, metrics_port = _free_port(), _free_port(), _free_port()
        self.config = MooncakeConfig(master=f"127.0.0.1:{self.rpc_port}",
                                     metadata_server=f"http://127.0.0.1:{http_port}/metadata")
        log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={metrics_port}"],
            stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)  # never outlive this process
        deadline = time.monotonic() + start_timeout_s
        while not all(_listening(p) for p in (self.rpc_port, http_port)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SeerError(f"mooncake_master did not start on 127.0.0.1:{self.rpc_port}"
                                + (f" (log: {log_path})" if log_path else ""))
            time.sleep(0.05)

    def stop(self) -> None:
        """Close this process's clients of this master, then stop it."""
        with _CLIENTS_LOCK:
            for c in [c for c in _CLIENTS if c.master == self.config.master]:
                _CLIENTS.pop(c).close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LoopbackMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
