"""Replay study, modelled tail, rollout files and the drafting benchmark entry point."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from seer_jax.analysis.drafting_replay import (
    ArcticDrafter,
    CopyOracleDrafter,
    GroupRollout,
    OursDrafter,
    ReplayStats,
    load_rollouts_jsonl,
    load_texts_jsonl,
    replay,
    replay_group,
    save_rollouts_jsonl,
    simulate_tail,
)
from seer_jax.analysis.synthetic_text import synthetic_groups
from seer_jax.drafting import BudgetConfig, DraftConfig, SpeculationBudget
from seer_jax.drafting.calibration import (
    SpecCalibration,
    build_calibration,
    position_rates,
    write_calibration,
)
from seer_jax.errors import InputError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_replay_counts_accepted_tokens_exactly():
    # Two identical responses; lock-step, no stagger. Request 1 sees request 0's text only up
    # to the same position, so nothing to copy from the sibling; staggered by 3 steps it can.
    resp = [10, 11, 12, 13, 14, 15]
    g = GroupRollout("g", [1, 2], [resp, list(resp)])
    lock = ReplayStats()
    replay_group(g, OursDrafter.factory(DraftConfig(min_prob=0.0))(g), lock)
    assert lock.steps == 12 and lock.accepted == 0
    stag = ReplayStats()
    replay_group(g, OursDrafter.factory(DraftConfig(min_prob=0.0))(g), stag, stagger=[0, 3])
    # request 1 at position p sees min(p + 3, 6) sibling tokens: its draft is the sibling's
    # tokens after its own text, all correct: 3, 3, 3, 3 (p=0..3), then the 2 and 1 left
    assert stag.accepted == stag.proposed == 3 + 3 + 3 + 3 + 2 + 1
    assert stag.specs == 6
    s = stag.summary()
    assert s["accepted_per_step"] == pytest.approx((stag.accepted + 12) / 12)


def test_group_modes_beat_per_request_on_shared_phrases():
    groups = synthetic_groups(4, 6, 120, mix="structured", seed=3)
    per = replay(groups, OursDrafter.factory(DraftConfig(mode="per_request"))).summary()
    grp = replay(groups, OursDrafter.factory(DraftConfig(mode="group"))).summary()
    tree = replay(groups, OursDrafter.factory(DraftConfig(), 16, 8, 4)).summary()
    assert grp["accepted_per_spec"] > 2 * per["accepted_per_spec"]
    assert tree["accepted_per_step"] >= grp["accepted_per_step"]
    assert tree["draft_tokens_per_spec"] > grp["draft_tokens_per_spec"]


def test_copy_bound_is_the_longest_copyable_continuation():
    # r1 starts when r0 has finished: its continuation 5 6 7 follows the prompt's last token in
    # r0's text (group context), never in its own (prompt only)
    g = GroupRollout("g", [1, 2], [[5, 6, 7, 8], [5, 6, 7, 9]])
    grp, own = ReplayStats(), ReplayStats()
    replay_group(g, CopyOracleDrafter(g, siblings=True), grp, stagger=[0, 4])
    replay_group(g, CopyOracleDrafter(g, siblings=False), own, stagger=[0, 4])
    assert grp.accepts == [0, 0, 0, 0, 3, 2, 1, 0]  # r0's 4 steps, then r1's
    assert own.accepts == [0] * 8
    # match_len 0: anywhere in the context; depth caps the copy
    anywhere = ReplayStats()
    replay_group(g, CopyOracleDrafter(g, siblings=True, depth=2, match_len=0), anywhere,
                 stagger=[0, 4])
    assert anywhere.accepts == [0, 0, 0, 0, 2, 2, 1, 0]
    with pytest.raises(InputError, match="depth >= 1"):
        CopyOracleDrafter(g, siblings=True, depth=0)


@pytest.mark.parametrize("mix", ["natural", "structured"])
def test_suffix_drafts_never_beat_the_copy_bound_at_any_step(mix):
    """Every path of our drafts continues a match of length >= 1, so at each step what it gets
    accepted is at most the copy bound of the same context (own or group)."""
    groups = synthetic_groups(3, 5, 80, mix=mix, seed=7)
    for mode, siblings in (("per_request", False), ("group", True)):
        bound = replay(groups, lambda g, sib=siblings: CopyOracleDrafter(g, sib, depth=8))
        assert bound.accepted > 0
        for nodes, width in ((8, 1), (16, 4)):
            ours = replay(groups, OursDrafter.factory(DraftConfig(mode=mode, min_prob=0.0),
                                                      nodes, 8, width))
            assert all(a <= b for a, b in zip(ours.accepts, bound.accepts, strict=True)), mode
            assert ours.accepted <= bound.accepted


def test_accepted_per_spec_at_rates_ranks_steps_by_the_drafters_own_score():
    st = ReplayStats(steps=10, specs=6, scores=[0.0, 3.0, 1.0, 0.5, 2.0, 0.0, 0.2, 0.1, 0.0, 0.0],
                     accepts=[0, 2, 0, 1, 3, 0, 0, 0, 0, 0])
    at = st.accepted_per_spec_at_rates((0.1, 0.2, 0.3, 0.5, 0.7))
    # top 1: score 3 (2 accepted); top 2: + score 2 (3); top 3: + score 1 (0); top 5: + 0.5, 0.2
    assert at == {"0.1": 2.0, "0.2": 2.5, "0.3": pytest.approx(5 / 3), "0.5": 6 / 5, "0.7": None}


def test_rollouts_jsonl_roundtrip_and_errors(tmp_path):
    groups = synthetic_groups(2, 3, 20, seed=1)
    path = tmp_path / "r.jsonl"
    save_rollouts_jsonl(path, groups)
    back = load_rollouts_jsonl(path)
    assert [(g.group_id, g.prompt_ids, g.responses) for g in back] == [
        (g.group_id, g.prompt_ids, g.responses) for g in groups
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group_id": "x", "responses": [[1]]}\n')
    with pytest.raises(InputError, match="prompt_ids"):
        load_rollouts_jsonl(bad)
    with pytest.raises(InputError, match="not found"):
        load_rollouts_jsonl(tmp_path / "missing.jsonl")


def _roofline(b, g):
    n = b * (1 + g)
    return 1e-3 + max(4e-3, 4e-3 * n / 256) + 2e-6 * n


def test_tail_model_speeds_up_repetitive_groups_and_finishes_every_request():
    groups = synthetic_groups(4, 8, 160, mix="structured", seed=5)
    budget = SpeculationBudget(_roofline, BudgetConfig(beta_init=0.5))
    tail = simulate_tail(groups, budget, DraftConfig(), tail_fraction=0.25)
    assert tail["requests"] == 32
    assert tail["steps_spec"] < tail["steps_plain"]
    assert tail["tail_speedup"] > 1.0
    # the budget learned from the outcomes
    assert budget.stats.observations[0] > 0


def test_tail_model_without_speculation_when_budget_is_off():
    groups = synthetic_groups(2, 4, 80, mix="natural", seed=2)
    # step time linear in tokens: every draft token costs as much as a decode, never worth it
    budget = SpeculationBudget(lambda b, g: 1e-3 * b * (1 + g), BudgetConfig(beta_init=0.9))
    tail = simulate_tail(groups, budget)
    assert tail["steps_spec"] == tail["steps_plain"]
    assert tail["tail_speedup"] == pytest.approx(1.0)


@pytest.mark.skipif(not ArcticDrafter.available(), reason="arctic-inference not installed")
def test_arctic_peer_sees_siblings_only_in_group_mode():
    g = GroupRollout("g", [1, 2], [[10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 12]])
    arctic_group = ArcticDrafter(g, siblings=True, max_spec_factor=4.0, min_token_prob=0.0)
    arctic_own = ArcticDrafter(g, siblings=False, max_spec_factor=4.0, min_token_prob=0.0)
    for drafter in (arctic_group, arctic_own):
        for i, r in enumerate(g.responses):
            for t in r:
                drafter.append(i, t)
    ctx = [1, 2, 10, 11, 12]
    assert arctic_group.speculate(1, ctx).tokens.tolist()[:3] == [13, 14, 15]
    assert len(arctic_own.speculate(1, ctx)) == 0


def test_benchmark_script_writes_summary(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_drafting", ROOT / "benchmarks/drafting.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rollouts = tmp_path / "r.jsonl"
    save_rollouts_jsonl(rollouts, synthetic_groups(3, 4, 60, mix="structured", seed=0))
    out = tmp_path / "report.json"
    assert mod.main(["--rollouts", str(rollouts), "--json", str(out), "--no-arctic"]) == 0
    rep = json.loads(out.read_text())
    acc = rep["summary"]["accepted_per_spec"]
    assert set(acc) == {"per_request", "per_request_multipath", "group", "group_multipath"}
    assert acc["group"] > acc["per_request"]
    assert rep["summary"]["tail_speedup"] > 0
    assert rep["summary"]["best_group_accepted_per_spec_ratio_vs_per_request"] > 1
    cb = rep["summary"]["copy_bound_accepted_draft_per_step"]
    assert cb["group"] >= cb["per_request"] > 0
    # each mode's accepted draft tokens per step stay under its context's copy bound
    step = rep["summary"]["accepted_per_step"]
    assert step["group_multipath"] - 1 <= cb["group"]
    assert step["per_request_multipath"] - 1 <= cb["per_request"]
    assert set(rep["summary"]["best_group_accepted_per_spec_ratio_vs_per_request_at_rate"]) == {
        "0.1", "0.2", "0.3", "0.5"}


class _CharTokenizer:
    """Stands in for a real tokenizer: one token per character."""

    def encode_chat(self, messages):
        return [1] + [ord(ch) for ch in messages[0]["content"]]

    def encode_batch(self, texts, add_bos=False):
        return [[ord(ch) for ch in t] for t in texts]


def test_texts_jsonl_tokenizes_prompt_and_responses_with_a_cap(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"prompt_id": "q0", "prompt": "ab", "responses": ["xyz", "xy"],
                             "token_counts": [3, 2]}) + "\n")
    (g,) = load_texts_jsonl(p, _CharTokenizer())
    assert g.group_id == "q0" and g.prompt_ids == [1, 97, 98]
    assert g.responses == [[120, 121, 122], [120, 121]]
    (g,) = load_texts_jsonl(p, _CharTokenizer(), max_tokens_per_response=2)
    assert g.responses == [[120, 121], [120, 121]]
    (tmp_path / "bad.jsonl").write_text('{"responses": ["x"]}\n')
    with pytest.raises(InputError, match="bad.jsonl:1"):
        load_texts_jsonl(tmp_path / "bad.jsonl", _CharTokenizer())
    with pytest.raises(InputError, match="not found"):
        load_texts_jsonl(tmp_path / "missing.jsonl", _CharTokenizer())


def test_position_rates_offered_and_per_step():
    # steps: no draft; depth 2 with 2 accepted; depth 3 with 1 accepted; depth 1 with 0 accepted
    r = position_rates([0, 2, 3, 1], [0, 2, 1, 0], gamma_max=3)
    assert r["steps"] == 4
    # offered: position 1 tried by 3 drafts (2 accepted), position 2 by 2 (1 accepted),
    # position 3 by none (the depth-3 draft stopped at position 2)
    assert r["tried"] == [3, 2, 0]
    assert r["offered"] == pytest.approx([2 / 3, 1 / 2, 0.0])
    # per step: P(acc >= 1) = 2/4, P(acc >= 2 | acc >= 1) = 1/2, P(acc >= 3 | acc >= 2) = 0
    assert r["per_step"] == pytest.approx([0.5, 0.5, 0.0])
    # the cumulative product of per-step rates is accepted draft tokens per step
    assert float(np.cumprod(r["per_step"]).sum()) == pytest.approx((0 + 2 + 1 + 0) / 4)


def test_calibration_round_trip_from_a_replay(tmp_path):
    groups = synthetic_groups(3, 6, 80, mix="structured", seed=1)
    # uneven lengths, so siblings finish at different steps
    for g in groups:
        g.responses = [r[: 40 + 8 * i] for i, r in enumerate(g.responses)]
    solo = replay(groups, OursDrafter.factory(DraftConfig(mode="per_request"), 8, 8))
    grp = replay(groups, OursDrafter.factory(DraftConfig(mode="group"), 8, 8))
    assert max(grp.finished) >= 3 and min(grp.finished) == 0
    cal = build_calibration((solo.depths, solo.accepts), (grp.depths, grp.accepts, grp.finished),
                            gamma_max=8, source={"dataset": "synthetic"})
    # per step, the cumulative product is the replay's accepted draft tokens per step
    for stats, rates in ((solo, cal["solo"]), (grp, cal["group"])):
        assert float(np.cumprod(rates["per_step"]).sum()) == pytest.approx(
            stats.accepted / stats.steps, rel=1e-4)
    by = cal["group_by_finished"]
    assert by["buckets"] == [[0, 0], [1, 2], [3, 5], [6, None]]
    assert sum(r["steps"] for r in by["rates"]) == grp.steps
    assert by["rates"][3].get("empty") and by["rates"][3]["per_step"] == cal["group"]["per_step"]
    path = tmp_path / "cal.json"
    write_calibration(path, cal)
    loaded = SpecCalibration.load(path)
    assert loaded.gamma_max == 8
    assert loaded.solo == pytest.approx(cal["solo"]["per_step"], abs=1e-6)
    assert loaded.group == pytest.approx(cal["group"]["per_step"], abs=1e-6)
    assert loaded.rates_for(0) == pytest.approx(by["rates"][0]["per_step"], abs=1e-6)
    assert loaded.rates_for(2) == pytest.approx(by["rates"][1]["per_step"], abs=1e-6)
    assert loaded.rates_for(9) == pytest.approx(by["rates"][3]["per_step"], abs=1e-6)


def test_benchmark_writes_calibration(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_drafting", ROOT / "benchmarks/drafting.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rollouts = tmp_path / "r.jsonl"
    save_rollouts_jsonl(rollouts, synthetic_groups(2, 4, 50, mix="structured", seed=0))
    out, cal = tmp_path / "report.json", tmp_path / "cal.json"
    assert mod.main(["--rollouts", str(rollouts), "--json", str(out), "--no-arctic",
                     "--no-tail", "--calibration-out", str(cal)]) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["rollouts"] == ["r.jsonl"]  # names, not local paths
    assert rep["arctic_inference"] == "skipped: --no-arctic"
    assert {"command", "commit", "versions"} <= set(rep["provenance"])
    loaded = SpecCalibration.load(cal)
    assert loaded.group == pytest.approx(rep["calibration"]["group"]["per_step"], abs=1e-6)
