"""The array suffix automata (`ArenaDraftContext`, what the draft services use) draft exactly what
the reference `GroupDraftContext` over `SuffixAutomaton` drafts: same tokens, parents,
probabilities (bit for bit), depths and match lengths, for every configuration, on random and
on repetitive token streams, one request at a time and batched."""

from __future__ import annotations

import numpy as np
import pytest

from seer_jax.drafting import DraftConfig, GroupDraftContext
from seer_jax.drafting.arena import ArenaDraftContext
from seer_jax.drafting.service import DraftAppend, DraftQuery, InProcessDraftService
from seer_jax.errors import InputError


def assert_same(ref, got, where):
    assert got.tokens.tolist() == ref.tokens.tolist(), where
    assert got.parents.tolist() == ref.parents.tolist(), where
    assert got.probs.dtype == np.float32 and got.probs.tobytes() == ref.probs.tobytes(), where
    assert got.depths().tolist() == ref.depths().tolist(), where
    assert got.match_len == ref.match_len, where


def random_config(rng) -> DraftConfig:
    max_len = int(rng.integers(1, 10))
    return DraftConfig(
        mode=str(rng.choice(["group", "per_request"])), max_match_len=max_len,
        min_match_len=int(rng.integers(0, max_len + 1)),
        min_prob=float(rng.choice([0.0, 0.05, 0.3])), match_candidates=int(rng.integers(1, 4)),
        own_context=bool(rng.integers(2)), prior=float(rng.choice([0.0, 0.5, 1.0])),
        merge_trees=bool(rng.integers(2)),
        max_spec_factor=None if rng.integers(2) else float(rng.choice([0.5, 1.0, 2.0])),
        max_spec_offset=float(rng.choice([0.0, 1.0])))


def stream(rng, vocab: int, n: int, repetitive: bool) -> list[int]:
    """Random tokens, or a repeated phrase with occasional substitutions (text-like reuse)."""
    if not repetitive:
        return rng.integers(0, vocab, size=n).tolist()
    phrase = rng.integers(0, vocab, size=int(rng.integers(3, 12))).tolist()
    out = (phrase * (n // len(phrase) + 1))[:n]
    for i in np.flatnonzero(rng.random(n) < 0.1):
        out[i] = int(rng.integers(0, vocab))
    return out


def run_trial(rng, steps: int) -> None:
    cfg = random_config(rng)
    vocab = int(rng.integers(2, 12))
    repetitive = bool(rng.integers(2))
    prompt = stream(rng, vocab, int(rng.integers(0, 40)), repetitive)
    ref, new = GroupDraftContext(cfg, prompt), ArenaDraftContext(cfg, prompt)
    reqs = [f"r{i}" for i in range(int(rng.integers(1, 5)))]
    texts = {r: stream(rng, vocab, 4 * steps, repetitive) for r in reqs}
    pos = dict.fromkeys(reqs, 0)
    for step in range(steps):
        batch = []  # several requests' tokens in one call
        for r in reqs:
            if rng.random() < 0.7:
                k = int(rng.integers(1, 4))
                batch.append((r, texts[r][pos[r]:pos[r] + k]))
                pos[r] += k
        for r, toks in batch:
            ref.append(r, toks)
        new.append_many(batch)
        queries = [(r, int(rng.integers(0, 12)), int(rng.integers(0, 8)),
                    int(rng.integers(1, 5)), None if rng.random() < 0.8 else 0.1) for r in reqs]
        for q, got in zip(queries, new.speculate_many(queries), strict=True):
            assert_same(ref.speculate(*q), got, (cfg, step, q))
        if rng.random() < 0.05 and len(reqs) > 1:
            gone = reqs.pop(int(rng.integers(len(reqs))))
            ref.finish_request(gone)
            new.finish_request(gone)
    assert new.num_tokens() == ref.num_tokens() and new.num_states() == ref.num_states()
    if cfg.mode == "group":
        pattern = stream(rng, vocab, 8, repetitive)
        assert_same(ref.speculate_pattern(pattern, None, 8, 8, 2),
                    new.speculate_pattern(pattern, None, 8, 8, 2), (cfg, "pattern"))


def test_array_automata_draft_what_the_reference_drafts():
    rng = np.random.default_rng(0)
    for _ in range(24):
        run_trial(rng, steps=24)


@pytest.mark.exhaustive
def test_array_automata_draft_what_the_reference_drafts_long():
    rng = np.random.default_rng(1)
    for _ in range(300):
        run_trial(rng, steps=60)


@pytest.mark.parametrize("prompt_len,steps,vocab", [
    (1000, 12, 50), pytest.param(4000, 80, 12, marks=pytest.mark.exhaustive)])
def test_batched_service_drafts_what_the_reference_drafts_per_request(prompt_len, steps, vocab):
    """Groups of a long repetitive prompt (the host-overhead benchmark's setting) with default
    configuration: the service's batched appends and drafts, across groups, equal the
    reference's one request at a time; its arrays grow past their first capacity."""
    rng = np.random.default_rng(2)
    svc = InProcessDraftService()
    rows_svc = InProcessDraftService()  # fed and asked through the engine's row calls
    refs = {}
    groups = [str(g) for g in range(3)]
    for g in groups:
        prompt = (rng.integers(3, vocab, size=37).tolist() * (prompt_len // 37 + 1))[:prompt_len]
        svc.append(g, None, prompt)
        rows_svc.append(g, None, prompt)
        refs[g] = GroupDraftContext(DraftConfig(), prompt)
    reqs = [(g, f"{g}-{i}") for g in groups for i in range(4)]
    for step in range(steps):
        msgs = [DraftAppend.make(g, r, rng.integers(3, vocab, size=int(rng.integers(1, 4))))
                for g, r in reqs]
        svc.append_batch(msgs)
        rows_svc.append_rows([(m.group_id, m.request_id, m.token_ids.tolist()) for m in msgs])
        for m in msgs:
            refs[m.group_id].append(m.request_id, m.token_ids.tolist())
        width = 1 + step % 4
        queries = [DraftQuery(g, r, 8 * width, 8, width) for g, r in reqs]
        by_rows = rows_svc.speculate_rows([(g, r) for g, r in reqs], 8 * width, 8, width)
        for q, got, row in zip(queries, svc.speculate(queries), by_rows, strict=True):
            ref = refs[q.group_id].speculate(q.request_id, q.max_nodes, q.max_depth, q.width)
            assert_same(ref, got, (step, q))
            assert_same(ref, row, (step, q, "rows"))
    assert [rows_svc.version(g) for g in groups] == [svc.version(g) for g in groups]


def test_token_ids_outside_the_index_range_are_refused():
    ctx = ArenaDraftContext(DraftConfig(), [1, 2, 3])
    for bad in ([-1], [2**31]):
        with pytest.raises(InputError, match="token ids"):
            ctx.append("a", bad)
    with pytest.raises(InputError, match="token ids"):
        ctx.speculate_pattern([1, -2])


@pytest.mark.parametrize("mode", ["group", "per_request"])
def test_shared_arena_drafts_what_the_reference_drafts_as_groups_come_and_go(mode):
    """One service arena for every group: closing groups and finishing requests releases their
    automata, compaction drops their states (often here: min_dead 0) without changing any
    live group's drafts, and closing every group returns the arena to its first size."""
    rng = np.random.default_rng(3)
    cfg = DraftConfig(mode=mode, own_context=True)
    svc = InProcessDraftService(cfg)
    svc._arena.min_dead = 0
    refs, reqs, made = {}, {}, 0
    for step in range(40):
        if len(refs) < 4 and rng.random() < 0.5:  # a new group
            g = f"g{made}"
            made += 1
            prompt = stream(rng, 6, int(rng.integers(1, 60)), True)
            svc.append(g, None, prompt)
            refs[g] = GroupDraftContext(cfg, prompt)
            reqs[g] = [f"{g}-{i}" for i in range(int(rng.integers(1, 4)))]
        rows = [(g, r, stream(rng, 6, int(rng.integers(1, 4)), True))
                for g in refs for r in reqs[g]]
        svc.append_rows(rows)
        for g, r, t in rows:
            refs[g].append(r, t)
        asked = [(g, r) for g in refs for r in reqs[g]]
        for (g, r), got in zip(asked, svc.speculate_rows(asked, 8, 6, 1 + step % 3), strict=True):
            assert_same(refs[g].speculate(r, 8, 6, 1 + step % 3), got, (step, g, r))
        for g in list(refs):
            if len(reqs[g]) > 1 and rng.random() < 0.2:  # a request finishes
                r = reqs[g].pop()
                svc.finish_request(g, r)
                refs[g].finish_request(r)
            if rng.random() < 0.1:  # the group's rollout is over
                svc.close_group(g)
                del refs[g], reqs[g]
    assert svc._arena.compactions > 0
    for g in list(refs):
        svc.close_group(g)
    assert svc.num_states() == 0 and svc._arena.st.shape[0] == 64
