"""What an actor says reaches the driver (Ray forwards actors' stdout and stderr: log_to_driver),
and a multi-host slice's `jax.distributed` coordinator listens on the configured address, never
on every interface."""

from __future__ import annotations

import dataclasses
import ipaddress
import sys
import time

import pytest

from seer_jax.errors import ConfigError
from seer_jax.rollout.backends.ray_cluster import (
    LOOPBACK_ENV,
    RayBackendConfig,
    coordinator_bind,
    ensure_ray,
)
from seer_jax.rollout.config import default_config, validate_config

# the tests on a cluster run on the worker that holds it (`make test`: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("ray")

WILDCARDS = ("0.0.0.0", "::", "[::]")


# ---- without a cluster ---------------------------------------------------------------------------
@pytest.mark.parametrize("address", ["", "auto"])
def test_ensure_ray_forwards_actor_logs_to_the_driver(monkeypatch, address):
    ray = pytest.importorskip("ray")
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    for k, v in LOOPBACK_ENV.items():
        monkeypatch.setenv(k, v)
    ensure_ray(RayBackendConfig(address=address))
    assert len(calls) == 1 and calls[0]["log_to_driver"] is True
    # joins the configured cluster, or starts a new local one (never one found on the machine)
    assert calls[0]["address"] == (address or "local")


@pytest.mark.parametrize(("coordinator", "bind", "want"), [
    ("10.1.2.3:4567", "", "10.1.2.3:4567"),  # the leader's cluster address
    ("10.1.2.3:4567", "10.9.9.9", "10.9.9.9:4567"),
    ("127.0.0.1:80", "127.0.0.1", "127.0.0.1:80"),
    ("[fd00::1]:4567", "", "[fd00::1]:4567"),
    ("10.1.2.3:4567", "fd00::2", "[fd00::2]:4567"),
    ("10.1.2.3:4567", "[fd00::2]", "[fd00::2]:4567"),
])
def test_coordinator_bind_is_the_configured_host_with_the_coordinator_port(coordinator, bind, want):
    assert coordinator_bind(coordinator, bind) == want


@pytest.mark.parametrize("bad", [*WILDCARDS, "10.0.0.1:1234", "leader.example", "10.0.0", 5, None])
def test_bad_bind_addresses_are_refused_naming_the_key(bad):
    with pytest.raises(ConfigError, match=r"ray coordinator_bind_address=.* is invalid"):
        RayBackendConfig(coordinator_bind_address=bad).validate()
    if not isinstance(bad, str):
        return  # a rollout config holds a string (ConfigDict refuses other types)
    c = default_config()
    c.backend = "ray"
    c.ray_coordinator_bind_address = bad
    with pytest.raises(ConfigError, match=r"config\.ray_coordinator_bind_address=.* is invalid"):
        validate_config(c)


def test_wildcards_are_refused_because_the_coordinator_has_no_authentication():
    for bad in WILDCARDS:
        with pytest.raises(ConfigError, match="every interface .* no authentication"):
            coordinator_bind("10.1.2.3:4567", bad)


def test_the_leader_binds_the_configured_address_and_followers_bind_nothing(monkeypatch):
    """`EngineActor.join` (the code every host of a slice runs) hands jax.distributed the bind
    address: the leader's is the configured host (or its own cluster address), a follower runs
    no coordinator."""
    pytest.importorskip("ray")
    import jax

    from seer_jax.rollout.backends.ray_actor import EngineActor
    from tests.rollout.tiny_rollout import CFG, ENGINE

    class Stop(Exception):
        pass

    seen = []

    def initialize(**kw):
        seen.append(kw)
        raise Stop

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)  # no gloo switch in this process
    for host, bind, want in ((0, "", "10.1.2.3:4567"), (0, "10.7.7.7", "10.7.7.7:4567"),
                             (1, "10.7.7.7", None)):
        actor = EngineActor(0, CFG, "unused", "float32", ENGINE, tp=2, pool=None, eos_ids=None,
                            record_steps=False, host=host, hosts=2)
        with pytest.raises(Stop):
            actor.join("10.1.2.3:4567", 30, bind)
        assert seen[-1]["coordinator_address"] == "10.1.2.3:4567"
        assert seen[-1]["coordinator_bind_address"] == want
        assert seen[-1]["process_id"] == host and seen[-1]["num_processes"] == 2
    actor = EngineActor(0, CFG, "unused", "float32", ENGINE, tp=2, pool=None, eos_ids=None,
                        record_steps=False, host=0, hosts=2)
    with pytest.raises(ConfigError, match="every interface"):
        actor.join("10.1.2.3:4567", 30, "0.0.0.0")


# ---- on a local cluster ------------------------------------------------------------------------
def _wait_for(capfd, *markers, timeout_s=120.0):
    """The driver's output until every marker appeared in it (Ray's log monitor forwards actor
    output asynchronously); fails naming what never came."""
    seen = ""
    deadline = time.monotonic() + timeout_s
    while True:
        out, err = capfd.readouterr()
        seen += out + err
        missing = [m for m in markers if m not in seen]
        if not missing:
            return seen
        if time.monotonic() > deadline:
            pytest.fail(f"{missing} never reached the driver's output; it had:\n{seen[-3000:]}")
        time.sleep(0.2)


@pytest.mark.slow
def test_an_actors_output_warnings_and_traceback_reach_the_driver(ray_cluster, capfd):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Talker:
        def talk(self):
            import logging

            print("seer-test-stdout-line", flush=True)
            print("seer-test-stderr-line", file=sys.stderr, flush=True)
            logging.getLogger("seer_jax.rollout.backends.ray_actor").warning("seer-test-warning")

        def fail(self):
            def engine_code():
                raise ValueError("seer-test-failure")

            try:
                engine_code()
            except ValueError:
                import traceback

                traceback.print_exc()  # what an actor prints before it raises
                raise

    talker = Talker.remote()
    try:
        ray.get(talker.talk.remote())
        _wait_for(capfd, "seer-test-stdout-line", "seer-test-stderr-line", "seer-test-warning")
        with pytest.raises(ray.exceptions.RayTaskError, match="seer-test-failure"):
            ray.get(talker.fail.remote())
        out = _wait_for(capfd, "seer-test-failure", "in engine_code")
        assert "Traceback (most recent call last)" in out
    finally:
        ray.kill(talker)


@pytest.mark.slow
def test_a_two_host_slices_coordinator_listens_on_the_leaders_cluster_address(ray_cluster):
    """A real two-host slice on the local cluster: the leader's jax.distributed coordinator
    listens on the leader's cluster address (the one the follower connects to), on no wildcard
    address."""
    psutil = pytest.importorskip("psutil")
    from seer_jax.rollout.backends.ray_group import make_ray_instances
    from tests.rollout.tiny_rollout import CFG, ENGINE, PARAMS

    group = make_ray_instances(CFG, PARAMS, num_instances=1, tp=2, engine_config=ENGINE,
                               backend=RayBackendConfig(hosts_per_slice=2, step_timeout_s=120.0))
    try:
        leader = group.instances[0].actors[0]

        def coordinator(actor):
            from jax._src import distributed

            return distributed.global_state.coordinator_address

        address = ray_cluster.get(leader.__ray_call__.remote(coordinator))
        host, port = address.rsplit(":", 1)
        assert host not in WILDCARDS
        listening = [c.laddr for c in psutil.Process(group.instances[0].snap.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port)]
        assert [_plain_ip(a.ip) for a in listening] == [_plain_ip(host.strip("[]"))]
    finally:
        group.shutdown()


def _plain_ip(text: str) -> str:
    """An address as IPv4 when it is an IPv4-mapped IPv6 one (::ffff:a.b.c.d: an IPv6 socket
    bound to that one IPv4 address)."""
    ip = ipaddress.ip_address(text)
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def test_the_default_bind_address_is_the_leaders_own():
    assert RayBackendConfig().coordinator_bind_address == ""
    assert default_config().ray_coordinator_bind_address == ""
    assert dataclasses.replace(RayBackendConfig(), coordinator_bind_address="10.0.0.2").validate()
