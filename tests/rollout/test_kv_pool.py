"""The global KV pool contract (versions, LRU eviction, byte accounting, lost blobs), run on every
backend that can start here: the in-process host pool, and Mooncake Store on a loopback master
when the `mooncake` extra is installed."""

from __future__ import annotations

import pytest

from seer_jax.errors import ConfigError
from seer_jax.rollout.backends.kv_pool import HostKVPool
from tests.rollout.mooncake_util import TextBlobs


@pytest.fixture(scope="module")
def mooncake_master():
    from tests.rollout.mooncake_util import loopback_master_or_skip

    with loopback_master_or_skip() as master:
        yield master


@pytest.fixture(params=["host", "mooncake"])
def make_pool(request):
    """A factory of empty pools of one backend: make_pool(capacity_bytes=None)."""
    if request.param == "host":
        yield HostKVPool
        return
    from seer_jax.rollout.backends.mooncake_pool import MooncakeKVPool

    master = request.getfixturevalue("mooncake_master")
    made = []

    def make(capacity_bytes=None):
        made.append(TextBlobs(MooncakeKVPool(master.config, capacity_bytes)))
        return made[-1]

    yield make
    for pool in made:
        pool.shutdown()


def test_put_get_and_bytes_moved(make_pool):
    pool = make_pool()
    h = pool.put("r1", "blob1", 100)
    assert pool.get(h) == "blob1"
    assert pool.get(h) == "blob1"
    st = pool.stats()
    assert (st.bytes_put, st.bytes_got, st.bytes_moved) == (100, 200, 300)
    assert st.used_bytes == 100 and st.entries == 1 and st.hits == 2


def test_new_version_replaces_and_stale_handle_misses(make_pool):
    pool = make_pool()
    h1 = pool.put("r1", "v1", 10)
    h2 = pool.put("r1", "v2", 30)
    assert h1 != h2
    assert pool.get(h1) is None
    assert pool.get(h2) == "v2"
    st = pool.stats()
    assert st.used_bytes == 30 and st.misses == 1


def test_lru_eviction_respects_recent_use(make_pool):
    pool = make_pool(capacity_bytes=100)
    ha = pool.put("a", "A", 40)
    hb = pool.put("b", "B", 40)
    assert pool.get(ha) == "A"  # a is now most recent
    hc = pool.put("c", "C", 40)  # evicts b (least recently used)
    assert pool.get(hb) is None
    assert pool.get(ha) == "A" and pool.get(hc) == "C"
    st = pool.stats()
    assert st.evictions == 1 and st.bytes_evicted == 40 and st.used_bytes == 80
    assert st.peak_used_bytes <= 100


def test_blob_larger_than_capacity_is_not_stored(make_pool):
    pool = make_pool(capacity_bytes=50)
    keep = pool.put("a", "A", 20)
    h = pool.put("big", "X", 51)
    assert pool.get(h) is None
    assert pool.get(keep) == "A"
    st = pool.stats()
    assert st.entries == 1 and st.used_bytes == 20 and st.evictions == 1


def test_delete_frees_bytes(make_pool):
    pool = make_pool(capacity_bytes=100)
    h = pool.put("a", "A", 60)
    pool.delete("a")
    pool.delete("never-stored")
    assert pool.get(h) is None
    assert pool.stats().used_bytes == 0


def test_contains_does_not_count_as_a_use():
    pool = HostKVPool(capacity_bytes=50)
    keep = pool.put("a", "A", 20)
    h = pool.put("big", "X", 51)
    assert not pool.contains(h) and pool.contains(keep)
    assert pool.stats().hits == 0


def test_bad_capacity():
    with pytest.raises(ConfigError, match="capacity_bytes=-1"):
        HostKVPool(capacity_bytes=-1)


def test_lost_blobs_are_dropped_and_counted():
    pool = HostKVPool()
    h = pool.put("a", "A", 60)
    keep = pool.put("b", "B", 10)
    gone = pool.put("c", "C", 5)
    assert pool.get(h) == "A"
    pool.lose_read(h)  # the backend found the blob gone with its writer when reading it
    pool.lose_read(h)  # a second report of the same loss changes nothing
    assert pool.lose("c") and not pool.lose("c")  # its writer was lost
    assert pool.get(h) is None and pool.get(gone) is None and pool.get(keep) == "B"
    st = pool.stats()
    assert (st.hits, st.misses, st.lost, st.bytes_got) == (1, 3, 2, 10)
    assert st.used_bytes == 10 and st.entries == 1


def test_dropped_blobs_are_reported_to_the_backend():
    dropped = []
    pool = HostKVPool(capacity_bytes=100, on_drop=dropped.append)
    pool.put("a", "A1", 40)
    pool.put("a", "A2", 40)  # replaces A1
    pool.put("b", "B", 50)
    pool.put("c", "C", 30)  # evicts A2 (least recently used)
    pool.put("big", "X", 101)  # never stored
    pool.delete("b")
    pool.lose("c")
    assert dropped == ["A1", "A2", "X", "B", "C"]
