"""Draft service: message-shaped appends, sync to replicas, batched speculation."""

from __future__ import annotations

import numpy as np
import pytest

from seer_jax.analysis.synthetic_text import synthetic_groups
from seer_jax.drafting import (
    DraftAppend,
    DraftConfig,
    DraftQuery,
    DraftReplica,
    DraftService,
    InProcessDraftService,
)
from seer_jax.errors import InputError


def _feed(service, groups, steps):
    """Prompts, then `steps` lock-step tokens of every response, one append batch per step."""
    for g in groups:
        service.append(g.group_id, None, g.prompt_ids)
    for t in range(steps):
        batch = [
            DraftAppend.make(g.group_id, f"r{i}", [r[t]])
            for g in groups
            for i, r in enumerate(g.responses)
            if t < len(r)
        ]
        service.append_batch(batch)


def _queries(groups, **kw):
    return [DraftQuery(g.group_id, f"r{i}", **kw) for g in groups for i in range(len(g.responses))]


def test_service_implements_protocol_and_versions_count_messages():
    svc = InProcessDraftService(keep_log=True)
    assert isinstance(svc, DraftService)
    assert svc.append("g", None, [1, 2, 3]) == 1
    assert svc.append("g", "a", np.array([4, 5], np.int64)) == 2
    assert svc.version("g") == 2 and svc.version("other") == 0
    (up,) = svc.sync(["g"], 1)
    assert (up.since_version, up.version) == (1, 2)
    assert up.appends[0].request_id == "a" and up.appends[0].token_ids.dtype == np.int32
    with pytest.raises(InputError, match="since_version"):
        svc.sync(["g"], 5)
    with pytest.raises(InputError, match="1-D"):
        svc.append("g", "a", [[1, 2]])


def test_replica_after_sync_drafts_like_the_source():
    groups = synthetic_groups(3, 4, 60, mix="structured", seed=1)
    cfg = DraftConfig()
    svc = InProcessDraftService(cfg, keep_log=True)
    replica = DraftReplica(svc, cfg)
    ids = [g.group_id for g in groups]
    _feed(svc, groups, 30)
    assert replica.refresh(ids) == sum(svc.version(g) for g in ids)
    # incremental: only new messages on the next refresh
    for g in groups:
        for i, r in enumerate(g.responses):
            replica.append(g.group_id, f"r{i}", r[30:45])
    assert replica.refresh(ids) == sum(len(g.responses) for g in groups)
    assert replica.refresh(ids) == 0
    for width in (1, 3):
        a = svc.speculate(_queries(groups, max_nodes=12, width=width))
        b = replica.speculate(_queries(groups, max_nodes=12, width=width))
        assert sum(len(d) for d in a) > 0
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.parents, y.parents)
            np.testing.assert_array_equal(x.probs, y.probs)


def test_replica_lags_until_refresh():
    svc = InProcessDraftService(keep_log=True)
    rep = DraftReplica(svc)
    svc.append("g", None, [1])
    svc.append("g", "a", [5, 6, 7, 8, 9])
    rep.refresh(["g"])
    svc.append("g", "b", [5, 6])
    q = [DraftQuery("g", "b", max_nodes=3)]
    assert svc.speculate(q)[0].tokens.tolist() == [7, 8, 9]
    # the replica has not seen b's tokens: it drafts from the prompt's end, like a's start
    assert rep.speculate(q)[0].tokens.tolist() == [5, 6, 7]
    rep.refresh(["g"])
    assert rep.speculate(q)[0].tokens.tolist() == [7, 8, 9]


def test_speculate_batch_handles_unknown_groups_and_per_request_mode():
    svc = InProcessDraftService(DraftConfig(mode="per_request"), keep_log=True)
    svc.append("g", None, [1, 2])
    svc.append("g", "a", [3, 4, 5])
    svc.append("g", "b", [3, 4])
    out = svc.speculate([DraftQuery("g", "b"), DraftQuery("nope", "x"), DraftQuery("g", "a")])
    assert [len(d) for d in out] == [0, 0, 0]  # per-request: b never saw a's continuation
    svc.close_group("g")
    assert svc.version("g") == 0 and svc.sync(["g"])[0].appends == ()


def test_engine_flow_with_budget_respects_the_step_budget():
    """The loop an engine runs: plan, speculate, allocate, verify against the 'model' (recorded
    responses), append, observe. Every step stays within Γ and each request's cap; every request
    finishes with exactly its recorded tokens, in fewer steps than plain decoding."""
    from seer_jax.drafting import BudgetConfig, SpeculationBudget

    def step_time(b, g):
        n = b * (1 + g)
        return 1e-3 + max(4e-3, 4e-3 * n / 256) + 2e-6 * n

    groups = synthetic_groups(3, 6, 80, mix="structured", seed=4)
    svc = InProcessDraftService(DraftConfig())
    budget = SpeculationBudget(step_time, BudgetConfig())
    for g in groups:
        svc.append(g.group_id, None, g.prompt_ids)
    running = {(g.group_id, f"r{i}"): r for g in groups for i, r in enumerate(g.responses)}
    out = {k: [] for k in running}
    steps = 0
    while running:
        keys = list(running)
        plan = budget.plan(len(keys))
        drafts = []
        if plan.enabled:
            cand = svc.speculate([DraftQuery(g, r, plan.max_nodes_per_request, plan.max_depth,
                                             plan.width) for g, r in keys])
            prios = [int(r == "r0") for _, r in keys]  # one probe per group: high priority
            drafts = budget.allocate(cand, prios, plan)
            assert sum(len(d) for d in drafts) <= plan.total_tokens
            for d in drafts:
                d.validate()
                assert len(d) <= plan.max_nodes_per_request and d.depth <= plan.max_depth
        accepted = []
        appends = []
        for j, k in enumerate(keys):
            resp, pos = running[k], len(out[k])
            acc = drafts[j].accepted_length(resp[pos:]) if drafts else 0
            acc = min(acc, len(resp) - pos - 1)
            accepted.append(acc)
            new = resp[pos : pos + acc + 1]  # accepted drafts + the model's own (bonus) token
            out[k].extend(new)
            appends.append(DraftAppend.make(k[0], k[1], new))
            if len(out[k]) == len(resp):
                del running[k]
        svc.append_batch(appends)
        if drafts:
            budget.stats.observe_drafts(drafts, accepted)
        steps += 1
    for g in groups:
        for i, r in enumerate(g.responses):
            assert out[(g.group_id, f"r{i}")] == r
    assert steps < max(len(r) for g in groups for r in g.responses)
    assert budget.stats.observations[0] > 0


def test_the_service_keeps_at_most_max_groups_contexts_and_no_log_by_default():
    svc = InProcessDraftService(max_groups=2)
    for g in ("a", "b", "a", "c"):  # "b" is the least recently written when "c" arrives
        svc.append(g, None, [1, 2, 3])
    assert svc.context("b") is None and svc.version("b") == 0
    assert svc.context("a") is not None and svc.context("c") is not None
    with pytest.raises(InputError, match="keeps no append log"):
        svc.sync(["a"])
    with pytest.raises(InputError, match="max_groups=0"):
        InProcessDraftService(max_groups=0)
