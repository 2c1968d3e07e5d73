"""Ray cluster settings for the distributed backend: joining or starting a cluster, placement.

`RayBackendConfig` holds what the Ray backend needs beyond the engine: the cluster address
(empty: start a local cluster on loopback), the resource each instance's bundle reserves (`CPU`
on a dev box, `GPU` or `TPU` on accelerators), the placement strategy of the bundles (one bundle
per host: `STRICT_SPREAD` on a pod puts every slice on its own host; `PACK`/`SPREAD` work on
one machine), the step timeout after which a silent actor counts as lost, and the object-store
size of a local cluster.

Ray is an optional dependency (`pip install seer-jax[ray]`): this module imports it lazily and
`require_ray()` turns its absence into a ConfigError that says how to install it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import pathlib
import sys
from typing import Any

from seer_jax.engine.scatter_check import ENV as SCATTER_CHECK_ENV
from seer_jax.errors import ConfigError

RESOURCES = ("CPU", "GPU", "TPU")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# a quiet loopback cluster (see docs/deployment.md): no dashboard, no usage stats, no auth token
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


CPU_CORE_ENV = "SEER_JAX_ACTOR_CPU_CORE"  # pin_cpus: the core an engine actor runs on


def pin_to_cpu_core() -> int | None:
    """In an engine actor: pin this process to the core `CPU_CORE_ENV` names (before XLA starts
    its thread pool, which then has one thread); the core, or None when not asked to."""
    core = os.environ.get(CPU_CORE_ENV)
    if core is None:
        return None
    os.sched_setaffinity(0, {int(core)})
    return int(core)


@dataclasses.dataclass
class RayBackendConfig:
    """address: "" = start a local cluster on 127.0.0.1; otherwise a cluster address
    ("auto", "ray://host:10001", "host:6379").
    resource: what one instance's bundle reserves: "CPU" (dev box; the actor gets `tp` fake
    CPU devices), "GPU" or "TPU" (`tp` of them, the slice's chips on its host).
    strategy: placement-group strategy of the bundles (one bundle per instance/host).
    step_timeout_s: the least time a step may run before its actor is killed and lost (the first
    step, which compiles, included); later steps may run up to `step_timeout_factor` times the
    actor's longest step so far when that is more, so a loaded host or a long compile that
    slows every step does not lose an actor.
    step_timeout_factor: see step_timeout_s.
    liveness_interval_s: while waiting for a step, ping the actor when nothing came back for
    this long; the actor answers from its own thread (a separate Ray concurrency group), also
    in the middle of a step.
    liveness_timeout_s: an actor that does not answer a ping within this long is silent: lost.
    startup_timeout_s: how long starting an actor (imports, weights, engine build) may take.
    object_store_mb: object-store size of a local cluster (KV pool blobs and weights live there).
    num_cpus: logical CPUs of a local cluster (0 = max(os.cpu_count(), instances)).
    env: extra environment variables of every engine actor (e.g. a JAX compilation cache dir).
    hosts_per_slice: hosts one slice spans (one actor and one bundle per host, the slice's tp
    devices split evenly over them, joined under `jax.distributed`).
    pin_cpus: with resource "CPU" on one machine, pin the actor of bundle k to core
    k mod os.cpu_count() (before its XLA runtime starts, so XLA runs its computations on that
    one core): a dev box then emulates slices that own their devices, instead of every actor's
    XLA thread pool spreading over all cores and contending with the others.
    pipeline_depth: steps kept queued on each actor by the concurrent driver (1 = one step per
    round trip; 2 = the next step starts while the driver reads the last one's results).
    coordinator_bind_address: where the `jax.distributed` coordinator of a multi-host slice
    listens (on its leader, host 0): "" = the leader's cluster address (the Ray node address the
    other hosts connect to), or an IP address of the leader host. Never every interface (JAX's
    default, [::]): the coordinator has no authentication.
    """

    address: str = ""
    resource: str = "CPU"
    strategy: str = "SPREAD"
    step_timeout_s: float = 600.0
    step_timeout_factor: float = 10.0
    liveness_interval_s: float = 5.0
    liveness_timeout_s: float = 60.0
    startup_timeout_s: float = 600.0
    object_store_mb: int = 400
    num_cpus: int = 0
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # extra actor env vars
    hosts_per_slice: int = 1
    pin_cpus: bool = False
    pipeline_depth: int = 2
    coordinator_bind_address: str = ""

    def validate(self) -> RayBackendConfig:
        if self.resource not in RESOURCES:
            raise ConfigError(f"ray resource={self.resource!r} is invalid; allowed: {list(RESOURCES)}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"ray strategy={self.strategy!r} is invalid; allowed: {list(STRATEGIES)}")
        for key in ("step_timeout_s", "liveness_interval_s", "liveness_timeout_s",
                    "startup_timeout_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"ray {key}={value!r} is invalid; allowed: a number > 0")
        factor = self.step_timeout_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ConfigError(f"ray step_timeout_factor={factor!r} is invalid; allowed: a number >= 1")
        if not isinstance(self.object_store_mb, int) or self.object_store_mb < 80:
            raise ConfigError(
                f"ray object_store_mb={self.object_store_mb!r} is invalid; allowed: an integer >= 80")
        if not isinstance(self.num_cpus, int) or self.num_cpus < 0:
            raise ConfigError(f"ray num_cpus={self.num_cpus!r} is invalid; allowed: an integer >= 0")
        hosts = self.hosts_per_slice
        if not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1:
            raise ConfigError(
                f"ray hosts_per_slice={hosts!r} is invalid; allowed: an integer >= 1")
        if not isinstance(self.pin_cpus, bool):
            raise ConfigError(f"ray pin_cpus={self.pin_cpus!r} is invalid; allowed: True or False")
        depth = self.pipeline_depth
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 8:
            raise ConfigError(
                f"ray pipeline_depth={depth!r} is invalid; allowed: an integer from 1 to 8")
        check_bind_address(self.coordinator_bind_address)
        if self.pin_cpus and self.resource != "CPU":
            raise ConfigError(f"ray pin_cpus=True is invalid with resource={self.resource!r}; "
                              "allowed: resource='CPU'")
        return self

    def check_tp(self, tp: int) -> None:
        """ConfigError unless tp devices split evenly over the slice's hosts."""
        if tp % self.hosts_per_slice:
            raise ConfigError(f"ray hosts_per_slice={self.hosts_per_slice!r} is invalid for "
                              f"tp={tp}; allowed: a divisor of tp (each host holds tp / hosts "
                              "devices of the slice)")

    def bundle(self, tp: int) -> dict[str, float]:
        """The resources of one host's bundle (its tp / hosts_per_slice devices of the slice)."""
        per_host = tp // self.hosts_per_slice
        return {"CPU": 1.0} if self.resource == "CPU" else {self.resource: float(per_host)}

    def actor_env(self, tp: int, bundle_index: int = 0) -> dict[str, str]:
        """Environment of an engine actor (one host of a slice of tp devices, in placement-group
        bundle `bundle_index`), set before it imports jax."""
        env = {}
        if self.pin_cpus:
            env[CPU_CORE_ENV] = str(bundle_index % (os.cpu_count() or 1))
        jax = sys.modules.get("jax")
        precision = jax.config.jax_default_matmul_precision if jax is not None else None
        if precision:  # actors compute at the driver's matmul precision
            env["JAX_DEFAULT_MATMUL_PRECISION"] = str(precision)
        if self.resource == "CPU":
            env["JAX_PLATFORMS"] = "cpu"
            flags = os.environ.get("XLA_FLAGS", "")
            flags = " ".join(f for f in flags.split() if "xla_force_host_platform_device_count" not in f)
            per_host = tp // self.hosts_per_slice
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per_host}".strip()
        if os.environ.get(SCATTER_CHECK_ENV):  # the driver's scatter-check mode
            env[SCATTER_CHECK_ENV] = os.environ[SCATTER_CHECK_ENV]
        env.update(self.env)
        if not self.address:
            # a local cluster runs this checkout's code, even when it is not the installed one
            root = str(pathlib.Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        return env


def check_bind_address(value: Any) -> None:
    """ConfigError unless `value` is "" or an IP address that is not a wildcard."""
    allowed = ("allowed: '' (the slice leader's cluster address) or an IP address of the leader "
               "host, without a port")
    if not isinstance(value, str):
        raise ConfigError(f"ray coordinator_bind_address={value!r} is invalid; {allowed}")
    if not value:
        return
    try:
        ip = ipaddress.ip_address(value[1:-1] if value.startswith("[") else value)
    except ValueError:
        raise ConfigError(f"ray coordinator_bind_address={value!r} is invalid; {allowed}") from None
    if ip.is_unspecified:
        raise ConfigError(f"ray coordinator_bind_address={value!r} is invalid: it listens on every "
                          f"interface and the coordinator has no authentication; {allowed}")


def coordinator_bind(coordinator: str, bind_address: str = "") -> str:
    """The host:port the `jax.distributed` coordinator at `coordinator` (host:port) listens on:
    `bind_address` (checked by `check_bind_address`), or else the coordinator's own host, with
    the coordinator's port."""
    check_bind_address(bind_address)
    host, port = coordinator.rsplit(":", 1)
    host = bind_address or host
    if ":" in host and not host.startswith("["):  # IPv6
        host = f"[{host}]"
    return f"{host}:{port}"


def require_ray() -> Any:
    """The `ray` module, or a ConfigError saying how to get it."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "backend='ray' needs Ray, which is not installed; allowed: install the extra "
            "(pip install 'seer-jax[ray]') or use backend='inprocess'") from None
    return ray


def ensure_ray(config: RayBackendConfig, min_cpus: int = 1) -> Any:
    """Connect to `config.address`, or start a local loopback cluster; reuses a live connection."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    # actors' stdout and stderr (their warnings and tracebacks) are printed by the driver
    if config.address:
        ray.init(address=config.address, include_dashboard=False, log_to_driver=True)
        return ray
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    ray.init(
        address="local",  # a new cluster, never one another process started on this machine
        num_cpus=config.num_cpus or max(os.cpu_count() or 1, min_cpus),
        object_store_memory=config.object_store_mb * 1024 * 1024,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=True,
        configure_logging=False,
        # Ray runs its workers at nice 15 by default: beside any busy process at the normal
        # priority an engine actor then gets a few percent of a core and its steps (and the
        # first one's compile) take minutes. The engine actors are the workload: run them at
        # the driver's priority.
        _system_config={"worker_niceness": 0},
    )
    return ray
