"""Workload generators, trace replay and the ICC estimator."""

import dataclasses

import numpy as np
import pytest

from seer_jax.errors import ConfigError
from seer_jax.sim.workloads import (
    WORKLOAD_PRESETS,
    LengthModel,
    length_icc,
    load_trace,
    preset_workload,
    scale_workload,
    synthetic_workload,
    write_trace,
)


def test_icc_known_values():
    # identical within groups, different across -> 1; no group structure -> ~0
    assert length_icc([10, 10, 100, 100, 1000, 1000], [0, 0, 1, 1, 2, 2]) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    x = np.exp(rng.normal(5, 1, size=4000))
    assert abs(length_icc(x, np.repeat(np.arange(500), 8))) < 0.05
    assert length_icc([1, 2], [0, 0]) == 0.0  # one group: undefined -> 0


@pytest.mark.parametrize("icc", [0.0, 0.3, 0.8])
def test_synthetic_hits_target_icc_and_truncation(icc):
    lm = LengthModel(num_prompts=600, group_size=8, max_tokens=32768, sigma=1.0, icc=icc,
                     truncated_fraction=0.05, min_tokens=1)
    w = synthetic_workload(lm, seed=1)
    assert w.num_responses == 4800 and w.num_groups == 600
    assert w.output_len.max() <= 32768 and w.output_len.min() >= 1
    s = w.stats()
    assert s["length_icc_log"] == pytest.approx(icc, abs=0.08)
    assert s["truncated_fraction"] == pytest.approx(0.05, abs=0.03)
    # groups are contiguous blocks of group_size
    assert (w.group_index == np.repeat(np.arange(600), 8)).all()


def test_tail_heaviness_increases_token_share_of_longest():
    light = synthetic_workload(LengthModel(400, 8, 65536, sigma=0.4, truncated_fraction=0.01), 0)
    heavy = synthetic_workload(LengthModel(400, 8, 65536, sigma=1.5, truncated_fraction=0.01), 0)
    assert heavy.stats()["longest_10pct_token_share"] > light.stats()["longest_10pct_token_share"]


def test_seed_determinism():
    a = preset_workload("moonlight", seed=3)
    b = preset_workload("moonlight", seed=3)
    c = preset_workload("moonlight", seed=4)
    assert (a.output_len == b.output_len).all() and (a.prompt_len == b.prompt_len).all()
    assert not (a.output_len == c.output_len).all()


def test_paper_presets_shapes():
    shapes = {"moonlight": (400, 8, 65536), "qwen2-vl-72b": (600, 16, 40960),
              "kimi-k2": (800, 8, 98304)}
    for name, (p, g, mt) in shapes.items():
        lm = WORKLOAD_PRESETS[name]
        assert (lm.num_prompts, lm.group_size, lm.max_tokens) == (p, g, mt)
    w = preset_workload("kimi-k2")
    assert w.num_responses == 6400


def test_invalid_length_model():
    with pytest.raises(ConfigError, match="max_tokens=0"):
        synthetic_workload(LengthModel(4, 2, max_tokens=0))
    with pytest.raises(ConfigError, match="icc=1.5"):
        synthetic_workload(LengthModel(4, 2, 100, icc=1.5))
    with pytest.raises(ConfigError, match="unknown workload preset"):
        preset_workload("nope")


def test_trace_roundtrip_and_scaling(tmp_path):
    w = synthetic_workload(LengthModel(20, 4, 1000, truncated_fraction=0.1), seed=2)
    path = tmp_path / "trace.jsonl"
    write_trace(w, path)
    r = load_trace(path)
    assert r.max_tokens == 1000
    assert (r.output_len == w.output_len).all() and (r.prompt_len == w.prompt_len).all()
    assert r.group_ids == w.group_ids
    assert length_icc(r.output_len, r.group_index) == pytest.approx(
        length_icc(w.output_len, w.group_index))
    big = scale_workload(r, 50, seed=0)
    assert big.num_groups == 50 and big.num_responses == 200
    assert set(big.output_len.tolist()) <= set(w.output_len.tolist())


def test_trace_interleaved_groups_and_errors(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"group_id": "a", "prompt_len": 5, "output_len": 7}\n'
                 '{"group_id": "b", "prompt_len": 6, "output_len": 9}\n\n'
                 '{"group_id": "a", "prompt_len": 5, "output_len": 3}\n')
    w = load_trace(p, max_tokens=16)
    assert w.group_ids == ["a", "b"]
    assert w.group_index.tolist() == [0, 0, 1]
    assert w.output_len.tolist() == [7, 3, 9]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group_id": "a", "prompt_len": 5}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_trace(bad)
    with pytest.raises(ConfigError, match="> max_tokens"):
        load_trace(p, max_tokens=8)


def test_synthetic_workload_keeps_its_generating_distributions(tmp_path):
    lm = LengthModel(300, 8, 65536, sigma=1.1, icc=0.6, truncated_fraction=0.02)
    w = synthetic_workload(lm, seed=4)
    dists = w.length_distributions()
    assert list(dists) == w.group_ids
    sd = {s for _, s in dists.values()}
    assert len(sd) == 1 and sd.pop() == pytest.approx(np.sqrt(0.4) * 1.1)
    # the lengths are draws from them: standardized log residuals ~ N(0, 1) (uncapped ones,
    # away from the min_tokens floor)
    med = np.array([dists[w.group_ids[g]][0] for g in w.group_index])
    z = (np.log(w.output_len) - med) / np.sqrt(0.4) / 1.1
    keep = ~w.truncated & (w.output_len > lm.min_tokens)
    assert abs(z[keep].mean()) < 0.05 and z[keep].std() == pytest.approx(1.0, abs=0.05)
    # group medians spread by the between-group sd around the preset's median
    assert np.std(w.group_log_median) == pytest.approx(np.sqrt(0.6) * 1.1, rel=0.12)
    path = tmp_path / "t.jsonl"
    write_trace(w, path)
    assert load_trace(path).length_distributions() is None  # a trace's are unknown
    assert scale_workload(w, 10).length_distributions() is None
    with pytest.raises(ConfigError, match="group_log_median has 3 entries for 300 groups"):
        dataclasses.replace(w, group_log_median=w.group_log_median[:3])
