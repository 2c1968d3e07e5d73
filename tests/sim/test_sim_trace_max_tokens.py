"""A replayed trace keeps its own max_tokens unless the config sets one (configs/sim/r1_aime.py)."""

from __future__ import annotations

import json

import pytest

from seer_jax.analysis.policies import CATALOG
from seer_jax.config_files import load_config_file
from seer_jax.errors import ConfigError
from seer_jax.sim import simulator as sim

SMALL = "configs/sim/small.py"
MOONLIGHT = "configs/sim/moonlight.py"


def _trace(tmp_path, cap: int = 3000, longest: int = 2500):
    p = tmp_path / "t.jsonl"
    rows = [{"group_id": f"g{g}", "prompt_len": 100, "output_len": n, "max_tokens": cap}
            for g, lens in enumerate([(400, longest), (900, 1200)]) for n in lens]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_trace_max_tokens_wins_over_the_preset(tmp_path):
    # the Moonlight preset's synthetic cap (65,536) must not replace the trace's (3,000)
    c = load_config_file(MOONLIGHT, [f"--config.workload.trace_path='{_trace(tmp_path)}'"])
    assert c.workload.max_tokens == 65536
    sim.validate_config(c, CATALOG)
    assert sim.build_workload(c).max_tokens == 3000
    assert sim.max_tokens_source(c) == "the trace"


def test_explicit_trace_max_tokens_is_used_and_named(tmp_path):
    c = load_config_file(SMALL, [f"--config.workload.trace_path='{_trace(tmp_path)}'",
                                 "--config.workload.trace_max_tokens=5000"])
    sim.validate_config(c, CATALOG)
    assert sim.build_workload(c).max_tokens == 5000
    assert sim.max_tokens_source(c) == "config.workload.trace_max_tokens"
    assert sim.max_tokens_source(load_config_file(SMALL)) == "config.workload.max_tokens"


def test_explicit_trace_max_tokens_below_longest_response_is_an_error(tmp_path):
    c = load_config_file(SMALL, [f"--config.workload.trace_path='{_trace(tmp_path)}'",
                                 "--config.workload.trace_max_tokens=2000"])
    with pytest.raises(ConfigError, match=r"trace_max_tokens=2000 .* \(2500 tokens\); "
                                          r"allowed: 0 .* >= 2500"):
        sim.validate_config(c, CATALOG)


def test_r1_aime_config_replays_the_committed_trace_at_its_own_cap():
    c = load_config_file("configs/sim/r1_aime.py")
    sim.validate_config(c, CATALOG)
    work = sim.build_workload(c)
    assert work.max_tokens == 16000 and work.num_groups == 400 and work.num_responses == 3200
    assert c.controller.chunk_size == work.max_tokens // 8
    assert c.cluster.num_instances == 32
    st = sim.wl.load_trace(c.workload.trace_path).stats()
    assert st["num_groups"] == 372 and st["num_responses"] == 2976
    assert st["length_icc_log"] == pytest.approx(0.62, abs=0.01)


def test_log_length_spread_recovers_the_synthetic_models_parameters():
    from seer_jax.sim.workloads import LengthModel, log_length_spread, synthetic_workload

    lm = LengthModel(num_prompts=800, group_size=8, max_tokens=10**7, sigma=0.56, icc=0.62,
                     truncated_fraction=1e-4, min_tokens=1)
    w = synthetic_workload(lm, seed=1)
    s = log_length_spread(w.output_len, w.group_index)
    assert s["icc"] == pytest.approx(0.62, abs=0.04)
    assert s["sigma_within"] == pytest.approx(0.56 * (1 - 0.62) ** 0.5, rel=0.05)
    assert s["sigma_between"] == pytest.approx(0.56 * 0.62**0.5, rel=0.08)
    assert s["sigma"] == pytest.approx(0.56, rel=0.05)


def test_sweep_reports_where_a_reference_trace_sits(tmp_path):
    c = load_config_file(SMALL, ["--config.workload.num_prompts=6", "--config.sweep.iccs=[0.5]",
                                 "--config.sweep.sigmas=[0.6]",
                                 "--config.sweep.policies='seer,request_fcfs'",
                                 f"--config.sweep.reference_trace='{_trace(tmp_path)}'"])
    trace = c.sweep.reference_trace
    ref = sim.sweep(c)["reference"]
    w = sim.wl.load_trace(trace)
    assert ref == {"trace": trace, **sim.wl.log_length_spread(w.output_len, w.group_index)}
    assert ref["sigma"] > 0
