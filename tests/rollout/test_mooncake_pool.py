"""The Mooncake Store KV pool beyond the shared contract (tests/rollout/test_kv_pool.py): config
and install errors, blobs freed in the store, what is read from the store is never unpickled,
and a real rollout whose migrated KV moves through a loopback master. Skipped with the reason when the `mooncake` extra or its libraries are absent."""

from __future__ import annotations

import sys

import jax
import pytest

from seer_jax.errors import ConfigError
from seer_jax.model.generate import generate
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.mooncake_pool import MooncakeConfig, MooncakeKVPool, require_mooncake
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams
from tests.rollout.mooncake_util import TextBlobs, text_blob
from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS


@pytest.fixture(scope="module")
def master():
    from tests.rollout.mooncake_util import loopback_master_or_skip

    with loopback_master_or_skip() as m:
        yield m


def _store_keys(pool):
    """The store keys of the blobs the pool's directory holds."""
    pool = getattr(pool, "pool", pool)
    return [keys[0] for _, keys, _ in pool.directory.pool._entries.values()]


class _Payload:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['MARK']).touch()",))


def test_a_pickle_or_malformed_blob_in_the_store_is_refused_and_nothing_runs(master, tmp_path,
                                                                              monkeypatch):
    """Whoever can write to the store cannot make a reader run code: what is read is decoded as
    a typed KV blob, and a pickle or a malformed blob is refused with KVBlobFormatError."""
    import pickle

    from seer_jax.rollout.backends.kv_codec import KVBlobFormatError
    from seer_jax.rollout.backends.mooncake_pool import _client

    mark = tmp_path / "ran"
    monkeypatch.setenv("MARK", str(mark))
    pool = MooncakeKVPool(master.config)
    store = _client(master.config)
    try:
        for bad, match in ((pickle.dumps(_Payload(), protocol=5), "not a seer KV blob"),
                           (b"SEERKV\x01\x00\xff\xff\x00\x00{", "header length")):
            h = pool.put("r", text_blob("good"), 24)
            (key,) = _store_keys(pool)
            assert store.remove(key, True) == 0 and store.put(key, bad) == 0  # overwritten
            with pytest.raises(KVBlobFormatError, match=match):
                pool.get(h)
            pool.delete("r")
        assert not mark.exists()
    finally:
        pool.shutdown()


def test_missing_mooncake_is_a_config_error_saying_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ConfigError, match=r"pip install 'seer-jax\[mooncake\]'.*libibverbs1"):
        require_mooncake()


@pytest.mark.parametrize("kwargs, msg", [
    (dict(master="localhost"), r"mooncake_master='localhost' is invalid; allowed: 'host:port'"),
    (dict(metadata_server="127.0.0.1:1"), r"mooncake_metadata_server='127.0.0.1:1' is invalid"),
    (dict(segment_mb=0), r"mooncake_segment_mb=0 is invalid; allowed: an integer >= 1"),
])
def test_config_errors_name_key_value_allowed(kwargs, msg):
    args = dict(master="127.0.0.1:5000", metadata_server="http://127.0.0.1:5001/metadata")
    with pytest.raises(ConfigError, match=msg):
        MooncakeConfig(**{**args, **kwargs}).validate()


def test_mooncake_config_keys(monkeypatch):
    from seer_jax.rollout.config import default_config, validate_config

    c = default_config()
    c.kv_pool, c.mooncake_master = "mooncake", "127.0.0.1:5000"
    with pytest.raises(ConfigError, match=r"config.mooncake_metadata_server='' is invalid: set it "
                                          r"together with mooncake_master"):
        validate_config(c)
    c.mooncake_metadata_server = "127.0.0.1:5001"
    with pytest.raises(ConfigError, match=r"config.mooncake_metadata_server='127.0.0.1:5001' is "
                                          r"invalid; allowed: 'http://host:port/metadata'"):
        validate_config(c)
    c.mooncake_metadata_server = "http://127.0.0.1:5001/metadata"
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ConfigError, match=r"kv_pool='mooncake' needs Mooncake Store"):
        validate_config(c)


def test_a_run_without_a_master_address_starts_a_loopback_master(master):
    from seer_jax.rollout.api import _KVPools
    from seer_jax.rollout.settings import PoolSettings

    pools = _KVPools(PoolSettings(kind="mooncake"))
    try:
        pool = pools.inprocess_pool()
        assert isinstance(pool, MooncakeKVPool) and pool.config.master == pools.master.config.master
        h = pool.put("r", text_blob("abc"), 24)
        assert pool.get(h).prompt_ids == [97, 98, 99]
        pool.shutdown()
    finally:
        pools.close()
    assert pools.master.proc.poll() is not None


def test_dropped_blobs_leave_the_store_and_keys_are_never_reused(master):
    from seer_jax.rollout.backends.mooncake_pool import _client

    store = _client(master.config)
    a, b = (TextBlobs(MooncakeKVPool(master.config, 100)),
            TextBlobs(MooncakeKVPool(master.config, 100)))
    try:
        ha = a.put("r", "a1", 40)
        (k1,) = _store_keys(a)
        hb = b.put("r", "b1", 40)  # same request id in another pool (another epoch)
        assert _store_keys(b)[0] != k1 and b.get(hb) == "b1" and a.get(ha) == "a1"
        a.put("r", "a2", 40)  # a new version: the old blob leaves the store
        (k2,) = _store_keys(a)
        assert k2 != k1 and store.is_exist(k1) == 0 and store.is_exist(k2) == 1
        a.put("s", "s1", 70)  # over capacity: r's blob is evicted and removed
        assert store.is_exist(k2) == 0 and a.stats().evictions == 1
        (k3,) = _store_keys(a)
        a.delete("s")
        assert store.is_exist(k3) == 0 and a.stats().entries == 0
        # a blob the store no longer has reads back as lost: the caller re-prefills
        hb2 = b.put("t", "t1", 10)
        kt = [k for k in _store_keys(b) if "/t/" in k][0]
        assert store.remove(kt, True) == 0
        assert b.get(hb2) is None and b.stats().lost == 1
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.slow
def test_rollout_migrates_kv_through_the_store_with_identical_greedy_tokens(master):
    pool = MooncakeKVPool(master.config)
    try:
        insts = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                                      pool=pool, devices=jax.devices()[:2])
        out = rollout(GROUPS, group_size=3, max_tokens=30, instances=insts,
                      sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                      config={"chunk_size": 8}, clock="concurrent")
        reference = generate(PARAMS, CFG, GROUPS, 30)
        assert sorted(r.request_id for r in out.results) == sorted(
            f"g{g}/{j}" for g in range(4) for j in range(3))
        for r in out.results:
            assert r.token_ids == reference[r.group_index].token_ids, r.request_id
        st = pool.stats()
        assert out.report.migrations > 0 and out.report.reprefill_tokens == 0
        assert st.bytes_got == out.report.kv_bytes_imported > 0
        assert st.bytes_put == out.report.kv_bytes_exported > 0
        assert out.report.kv_pool_transfer_gbps is not None and out.report.kv_pool_transfer_gbps > 0
        assert st.entries == 0 and _store_keys(pool) == []  # finished requests' KV was freed
    finally:
        pool.shutdown()


def test_blobs_stay_in_the_writers_segment_beside_a_dead_clients():
    """A client killed without closing leaves its segment in the master until its TTL; a put
    must not place the blob there (it would be unreadable): replicas go to the writer's own
    segment."""
    import signal
    import subprocess

    from tests.rollout.mooncake_util import loopback_master_or_skip

    with loopback_master_or_skip() as m:  # its own master: the dead segment stays out of others
        code = ("import time\n"
                "from seer_jax.rollout.backends.mooncake_pool import MooncakeConfig, _client\n"
                f"_client(MooncakeConfig(master={m.config.master!r}, "
                f"metadata_server={m.config.metadata_server!r}))\n"
                "print('up', flush=True)\ntime.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"up"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        pool = TextBlobs(MooncakeKVPool(m.config))
        try:
            got = [pool.get(pool.put(f"r{i}", f"v{i}", 10)) for i in range(20)]
        finally:
            pool.shutdown()
        assert got == [f"v{i}" for i in range(20)]
