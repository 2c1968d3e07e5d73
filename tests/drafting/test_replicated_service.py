"""The sharded draft service and its replicas (no Ray: shards in this process): each token
applied once whatever the order, stale replicas drafting from what they hold, a lost shard
rebuilt from the replicas, token gaps held until filled, closed groups leaving nothing behind,
and the `draft_service.*` config errors."""

from __future__ import annotations

import pytest

from seer_jax.analysis.synthetic_text import synthetic_groups
from seer_jax.drafting import DraftAppend, DraftQuery, InProcessDraftService
from seer_jax.drafting.replicated import (
    DraftShard,
    LocalShardLink,
    SyncConfig,
    SyncedReplica,
    shard_of,
)
from seer_jax.drafting.service import GroupUpdate
from seer_jax.errors import ConfigError


def _replicas(n, shards=2, delay_polls=0, max_stale=1):
    shard_objs = [DraftShard() for _ in range(shards)]
    sync = SyncConfig(shards=shards, max_stale_steps=max_stale)
    reps = [SyncedReplica([LocalShardLink(s, delay_polls) for s in shard_objs], sync)
            for _ in range(n)]
    return shard_objs, reps


def _run_lockstep(groups, reps, steps, owner):
    """Every response generated on replica owner(group, i), one token per step."""
    for g in groups:
        for i in range(len(g.responses)):
            reps[owner(g, i)].start_request(g.group_id, f"r{i}", g.prompt_ids, [])
            reps[owner(g, i)].append(g.group_id, None, g.prompt_ids)
    for t in range(steps):
        for r in reps:
            r.before_step()
        for g in groups:
            for i, resp in enumerate(g.responses):
                if t < len(resp):
                    reps[owner(g, i)].append(g.group_id, f"r{i}", [resp[t]])
        for r in reps:
            r.after_step()


def test_shard_applies_each_token_once_by_position():
    shard = DraftShard()
    assert shard.append_batch([DraftAppend.make("g", None, [1, 2, 3], 0),
                               DraftAppend.make("g", "a", [4, 5], 0)]) == 5
    # a re-sent prefix, an overlap and the prompt again: only token 6 is new
    assert shard.append_batch([DraftAppend.make("g", "a", [4], 0),
                               DraftAppend.make("g", "a", [5, 6], 1),
                               DraftAppend.make("g", None, [1, 2, 3], 0)]) == 1
    (up,) = shard.sync(["g"], {"g": 0})
    assert [(m.request_id, m.token_ids.tolist(), m.start) for m in up.appends] == [
        (None, [1, 2, 3], 0), ("a", [4, 5], 0), ("a", [6], 2)]
    (up,) = shard.sync(["g"], {"g": 99})  # a version from a shard this one replaced: from 0
    assert up.since_version == 0 and up.version == 3


def test_synced_replicas_draft_like_one_shared_service():
    groups = synthetic_groups(4, 4, 40, mix="structured", seed=3)
    shards, reps = _replicas(2, max_stale=0)
    _run_lockstep(groups, reps, 40, owner=lambda g, i: i % 2)
    ref = InProcessDraftService()
    for g in groups:
        ref.append(g.group_id, None, g.prompt_ids)
        for i, resp in enumerate(g.responses):
            ref.append(g.group_id, f"r{i}", resp[:40])
    for r in reps:  # one more step: pulls that see every replica's last push
        r.before_step()
    for r in reps:
        r.after_step()
    for r in reps:
        r.before_step()
    qs = [DraftQuery(g.group_id, f"r{i}") for g in groups for i in range(4)]
    want = [(d.tokens.tolist(), d.parents.tolist()) for d in ref.speculate(qs)]
    for rep in reps:
        for gid, reqs in rep._tokens.items():
            g = next(x for x in groups if x.group_id == gid)
            assert reqs[None] == g.prompt_ids
            assert all(reqs.get(f"r{i}", []) == g.responses[i][:40] for i in range(4))
    # same tokens, per request in the same order: same statistics (sibling order may differ,
    # so compare the drafts as sets of paths only where both agree on the context length)
    got = [(d.tokens.tolist(), d.parents.tolist()) for d in reps[0].speculate(qs)]
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= 0.9 * len(qs)
    total = sum(len(g.prompt_ids) + sum(len(r[:40]) for r in g.responses) for g in groups)
    assert sum(s.stats()["tokens"] for s in shards) == total
    st = reps[0].status()
    # replica 0 generated the even responses and pulled exactly the odd ones
    odd = sum(len(r[:40]) for g in groups for r in g.responses[1::2])
    assert st["pushes"] > 0 and st["bytes_pushed"] > 0 and st["remote_tokens"] == odd


def test_stale_replica_waits_only_for_due_pulls_and_lags_at_most_max_stale():
    groups = synthetic_groups(1, 2, 20, mix="structured", seed=1)
    _, reps = _replicas(2, shards=1, delay_polls=10, max_stale=2)
    g = groups[0]
    _run_lockstep(groups, reps, 10, owner=lambda g, i: i)
    # replica 0 never sees a pull arrive by itself (delay 10): it takes each one when due,
    # max_stale_steps = 2 steps after it was issued, and the next pull starts after that one;
    # so it lags by at most max_stale_steps + 2 steps of replica 1's tokens, and never more
    have = len(reps[0]._tokens[g.group_id].get("r1", []))
    assert 10 - (2 + 2) <= have < 10
    assert reps[0].stats.pulls >= 2 and reps[0].stats.remote_tokens == have


@pytest.mark.parametrize("k,m", [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 3), (3, 1)])
def test_replica_lag_reaches_exactly_the_stated_bound(k, m):
    """Replica a drafts for b's request; pulls answer only when waited for (as late as allowed)
    and a's pull is issued before b's push of the same step: the worst case. The largest number
    of steps a's drafts lack one of b's tokens is `SyncConfig.max_lag_steps()`."""
    sync = SyncConfig(shards=1, max_stale_steps=m, sync_every_steps=k)
    shard = DraftShard()
    a, b = (SyncedReplica([LocalShardLink(shard, delay_polls=10**6)], sync) for _ in range(2))
    a.start_request("g", "b", [1, 2], [])
    b.start_request("g", "b", [1, 2], [])
    worst = 0
    for t in range(8 * (k + m + 1)):
        a.before_step()
        b.before_step()
        worst = max(worst, t - len(a._tokens["g"].get("b", [])))  # b's tokens of steps < t
        b.append("g", "b", [t])
        a.after_step()
        b.after_step()
    assert worst == sync.max_lag_steps()


def test_a_reset_shard_drops_the_last_rollouts_late_pushes():
    """Group ids repeat across rollouts: a push of the last rollout landing after the shard's
    reset would take the positions of the new rollout's tokens (each position is kept once)."""
    shard = DraftShard()
    old = SyncedReplica([LocalShardLink(shard)], SyncConfig())
    old.start_request("g", "a", [1, 2, 3], [])
    old.append("g", None, [1, 2, 3])
    old.append("g", "a", [4, 5])
    shard.reset(epoch=1)  # the next rollout starts ...
    old.after_step()  # ... and the last rollout's push of its last step lands after it
    assert shard.stats()["tokens"] == 0 and shard.stats()["stale_dropped"] == 2
    new = SyncedReplica([LocalShardLink(shard)], SyncConfig(), epoch=1)
    new.start_request("g", "a", [7, 8], [])
    new.append("g", None, [7, 8])
    new.append("g", "a", [9])
    new.after_step()
    (up,) = shard.sync(["g"], {"g": 0}, epoch=1)
    assert [(m.request_id, m.token_ids.tolist()) for m in up.appends] == [(None, [7, 8]),
                                                                          ("a", [9])]
    assert shard.sync(["g"], {"g": 0}, epoch=0) == []  # a pull of the last rollout: nothing
    old.before_step()
    assert old.status()["remote_tokens"] == 0
    old.clear(epoch=1)  # the engine's replica joins the new rollout
    old.start_request("g", "a", [7, 8], [9])
    old.append("g", "a", [10])
    old.after_step()
    old.before_step()
    assert shard.stats()["tokens"] == 4 and old._tokens["g"]["a"] == [9, 10]


def test_lost_shard_replaced_is_rebuilt_from_the_replicas():
    groups = synthetic_groups(8, 2, 30, mix="structured", seed=2)
    assert {shard_of(g.group_id, 2) for g in groups} == {0, 1}
    shards, reps = _replicas(2, shards=2, max_stale=0)
    half = 15
    for g in groups:
        g.responses = [r[:half] for r in g.responses]
    _run_lockstep(groups, reps, half, owner=lambda g, i: i)
    for r in reps:
        r.links[0].dead = True
        r.before_step()
        r.after_step()
        r.before_step()
    assert all(r.down == {0} for r in reps) and all(r.status()["down"] == [0] for r in reps)
    new = DraftShard()
    for r in reps:
        r.replace_shard(0, LocalShardLink(new))
        r.after_step()
    in_shard0 = [g for g in groups if shard_of(g.group_id, 2) == 0]
    assert new.stats()["tokens"] == sum(len(g.prompt_ids) + sum(len(r) for r in g.responses)
                                        for g in in_shard0)
    assert all(r.down == set() and r.stats.shards_replaced == 1 for r in reps)


def test_shard_holds_tokens_past_a_gap_until_the_gap_is_filled():
    shard = DraftShard()
    shard.append_batch([DraftAppend.make("g", None, [1, 2], 0), DraftAppend.make("g", "a", [4, 5], 0)])
    # tokens 2..3 of request a are missing: 8, 9 (positions 4, 5) wait, never sit after 5
    assert shard.append_batch([DraftAppend.make("g", "a", [8, 9], 4)]) == 0
    assert shard.stats()["held"] == 1
    (up,) = shard.sync(["g"], {"g": 0})
    assert [m.token_ids.tolist() for m in up.appends if m.request_id == "a"] == [[4, 5]]
    # the missing tokens arrive (a replica re-seeding a rebuilt shard): the held ones follow
    assert shard.append_batch([DraftAppend.make("g", "a", [4, 5, 6, 7], 0)]) == 4
    (up,) = shard.sync(["g"], {"g": 0})
    got = [t for m in up.appends if m.request_id == "a" for t in m.token_ids.tolist()]
    assert got == [4, 5, 6, 7, 8, 9] and shard.stats()["held"] == 0


class _ScriptedLink:
    """A shard link whose pulls answer the given updates; it records each pull's versions."""

    def __init__(self, answers):
        self.answers, self.since = list(answers), []

    def push(self, appends, epoch):
        pass

    def pull(self, group_ids, since, epoch):
        self.since.append(dict(since))
        return self.answers.pop(0) if self.answers else [GroupUpdate(g, 0, 0, ()) for g in group_ids]

    def poll(self, handle, wait, timeout_s):
        return handle


def test_replica_resyncs_a_group_whose_pull_has_a_gap():
    prompt, a = DraftAppend.make("g", None, [1, 2], 0), DraftAppend.make("g", "a", [4, 5], 0)
    gapped = DraftAppend.make("g", "a", [8, 9], 4)  # positions 2, 3 never sent
    link = _ScriptedLink([[GroupUpdate("g", 0, 3, (prompt, a, gapped))],
                          [GroupUpdate("g", 0, 4, (prompt, a, DraftAppend.make("g", "a", [6, 7], 2),
                                                   gapped))]])
    rep = SyncedReplica([link], SyncConfig(max_stale_steps=0))
    rep.start_request("g", "b", [1, 2], [])
    rep.after_step()
    rep.before_step()
    assert rep._tokens["g"]["a"] == [4, 5] and rep.stats.resyncs == 1  # 8, 9 not out of place
    rep.after_step()
    rep.before_step()
    assert link.since == [{"g": 0}, {"g": 0}]  # the group was pulled again from the start
    assert rep._tokens["g"]["a"] == [4, 5, 6, 7, 8, 9] and rep.stats.resyncs == 1


def test_closed_groups_leave_shards_and_replicas_as_before_the_rollout():
    groups = synthetic_groups(4, 2, 12, mix="structured", seed=4)
    shards, reps = _replicas(2, shards=2)
    baseline = [s.stats() for s in shards]
    _run_lockstep(groups, reps, 12, owner=lambda g, i: i)
    for g in groups:
        for i in range(2):
            reps[i].finish_request(g.group_id, f"r{i}")
    last = [r._outbox[k][:] for r in reps for k in range(2)]  # a push still on its way
    for g in groups:  # the controller closes every group once its last request finished
        for s in shards:
            s.close_groups([g.group_id])
        for r in reps:
            r.close_group(g.group_id)
    for r in reps:
        r.after_step()
        r.before_step()
    for s, msgs in zip(shards * 2, last, strict=True):
        s.append_batch(msgs)  # late: dropped
    for s, before in zip(shards, baseline, strict=True):
        st = s.stats()
        assert (st["groups"], st["messages"], st["tokens"], st["held"]) == (0, 0, 0, 0)
        assert st["epoch"] == before["epoch"]
    for r in reps:
        assert not (r._ctx or r._tokens or r._pos or r._versions or r._active or r._group_of)
        assert not any(r._outbox) and r.status()["groups"] == 0
    reps[0].append(groups[0].group_id, "r0", [1])  # a late token of a closed group: dropped
    assert not reps[0]._tokens and not any(reps[0]._outbox)


@pytest.mark.exhaustive  # compiles a speculative engine (~35 s); the controller's side is in
# tests/rollout/test_controller.py, the Ray backend's in tests/rollout/test_ray_speculation.py
def test_inprocess_rollout_closes_every_group_it_ran():
    """Every engine's speculator, the shared draft service and the instances forget each group
    when its last request finishes: after the rollout they hold what they held before it."""
    import dataclasses

    import jax

    from seer_jax.engine.speculation import Speculator
    from seer_jax.rollout.backends.engine_instance import make_engine_instances
    from seer_jax.rollout.backends.kv_pool import HostKVPool
    from seer_jax.rollout.core.run import rollout
    from seer_jax.rollout.core.types import SamplingParams
    from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS

    service = InProcessDraftService(keep_log=True)
    specs = [Speculator(service) for _ in range(2)]
    pool = HostKVPool()
    insts = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1,
                                  engine_config=dataclasses.replace(ENGINE, num_pages=96,
                                                                    speculation=True),
                                  pool=pool, devices=jax.devices()[:2], speculators=specs)
    out = rollout(GROUPS, group_size=2, max_tokens=12, instances=insts,
                  sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                  config={"chunk_size": 4})
    assert len(out.results) == 2 * len(GROUPS)
    assert service._groups == {} and service._logs == {} and service._versions == {}
    assert all(s._prompted == set() for s in specs)
    assert all(i._prompts == {} for i in insts)


@pytest.mark.parametrize("key,value,allowed", [
    ("shards", 0, "an integer >= 1"), ("max_stale_steps", -1, "an integer >= 0"),
    ("sync_every_steps", 0, "an integer >= 1"), ("shards", 1.5, "an integer >= 1"),
    ("pull_timeout_s", 0, "a number of seconds > 0"),
    ("pull_timeout_s", "30", "a number of seconds > 0")])
def test_bad_sync_values_are_config_errors_naming_the_key(key, value, allowed):
    with pytest.raises(ConfigError, match=f"draft_service.{key}={value!r} is invalid: allowed: {allowed}"):
        SyncConfig(**{key: value}).validate()


@pytest.mark.parametrize("key,value,msg", [
    ("draft_service.shards", 0, r"config.draft_service.shards=0 is invalid: allowed: an integer >= 1"),
    ("draft_service.max_stale_steps", -2, r"config.draft_service.max_stale_steps=-2 is invalid"),
    ("draft_service.sync_every_steps", 0, r"config.draft_service.sync_every_steps=0 is invalid"),
    ("draft_service.replicas", 2, r"config.draft_service.replicas is unknown; allowed keys"),
    ("draft_service.pull_timeout_s", -1.0,
     r"config.draft_service.pull_timeout_s=-1.0 is invalid: allowed: a number of seconds > 0"),
    ("fault_kill_draft_service_after_chunks", -3,
     r"fault_kill_draft_service_after_chunks=-3 is invalid: allowed: -1 \(off\) or an integer >= 0"),
])
def test_bad_draft_service_config_names_the_key(key, value, msg):
    from seer_jax.rollout.config import default_config, validate_config

    c = default_config()
    c.backend, c.speculation = "ray", True
    *parents, leaf = key.split(".")
    node = c
    for k in parents:
        node = node[k]
    with node.unlocked():
        node[leaf] = value
    with pytest.raises(ConfigError, match=msg):
        validate_config(c)


def test_pull_timeout_is_a_config_key():
    from seer_jax.rollout.config import default_config, draft_sync_config

    c = default_config()
    assert draft_sync_config(c).pull_timeout_s == 30.0
    c.draft_service.pull_timeout_s = 5.0
    assert draft_sync_config(c).pull_timeout_s == 5.0


def test_speculation_is_allowed_on_ray_and_the_draft_fault_needs_it():
    from seer_jax.rollout.config import default_config, validate_config

    c = default_config()
    c.backend, c.speculation = "ray", True
    c.draft_service.shards = 3
    c.fault_kill_draft_service_after_chunks = 4
    assert validate_config(c) == ["seer"]
    c.backend = "inprocess"
    with pytest.raises(ConfigError, match="allowed: -1 unless backend='ray' and speculation=True"):
        validate_config(c)
