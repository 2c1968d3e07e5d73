"""Simulator: the real controller on simulated instances; determinism, conservation, config
errors, macro steps vs exact steps, speculation, sweep."""

import dataclasses
import functools
import json

import numpy as np
import pytest

from seer_jax.analysis.policies import CATALOG
from seer_jax.config_files import load_config_file
from seer_jax.errors import ConfigError
from seer_jax.sim import simulator as sim
from seer_jax.sim.workloads import write_trace

# the analysis catalog: these tests also run the oracles
simulate = functools.partial(sim.simulate, catalog=CATALOG)
compare = functools.partial(sim.compare, catalog=CATALOG)
sweep = functools.partial(sim.sweep, catalog=CATALOG)
ablation = sim.ablation


def validate_config(c):
    sim.validate_config(c, CATALOG)


SMALL = "configs/sim/small.py"


def _cfg(*overrides):
    c = load_config_file(SMALL, list(overrides))
    validate_config(c)
    return c


def _row(run):
    return {k: v for k, v in run.row().items() if not k.startswith("sim_wall")
            and k != "sim_events_per_s"}


def test_same_config_and_seed_identical_results():
    c = _cfg("--config.workload.num_prompts=12")
    a = simulate(c, "seer", speculation=True)
    b = simulate(c, "seer", speculation=True)
    assert _row(a) == _row(b)
    assert np.array_equal(a.steps, b.steps) and np.array_equal(a.latencies, b.latencies)
    c2 = _cfg("--config.workload.num_prompts=12", "--config.seed=1")
    assert _row(simulate(c2, "seer", speculation=True)) != _row(a)


@pytest.mark.parametrize("policy", ["seer", "group_round_robin", "request_fcfs", "oracle_lfs",
                                    "oracle_group_lfs", "seer_running_oracle",
                                    "seer_prompt_oracle", "oracle_conditional_quantile"])
def test_every_response_completes_with_its_length(policy):
    c = _cfg("--config.workload.num_prompts=12", "--config.cluster.kv_capacity_tokens=12000")
    work = sim.build_workload(c)
    run = simulate(c, policy, workload=work, keep_controller=True)
    ctl = run.controller
    assert ctl.done and run.report.num_responses == work.num_responses
    assert run.report.output_tokens == int(work.output_len.sum())
    for g, idx in enumerate(work.groups()):
        for j, i in enumerate(idx):
            r = ctl.requests[f"{work.group_ids[g]}/{j}"]
            assert r.generated == work.output_len[i]
            assert r.finish_reason == ("length" if work.output_len[i] >= work.max_tokens else "eos")
    # busy time never exceeds the makespan and steps are within it
    assert run.steps[:, 2].max() <= run.report.makespan_s + 1e-6
    assert (run.steps[:, 2] >= run.steps[:, 1]).all()


def test_overcommitting_baseline_preempts_and_seer_does_not():
    c = _cfg("--config.workload.num_prompts=16", "--config.cluster.kv_capacity_tokens=9000")
    runs = compare(c, ["group_round_robin", "seer"])
    assert runs["group_round_robin"].report.preemptions > 0
    assert runs["seer"].report.preemptions == 0


def test_macro_steps_match_exact_steps(monkeypatch):
    base = ("--config.workload.num_prompts=10", "--config.workload.max_tokens=1500",
            "--config.cluster.kv_capacity_tokens=10000")
    # the context-free policies' schedules, and seer's hedged and first_finisher rules (no
    # progress reads), are the same with macro steps as with exact steps
    for est in ("request_fcfs", "oracle_lfs", "first_finisher", "hedged"):
        policy = "seer" if est in ("first_finisher", "hedged") else est
        opt = (f"--config.policy.seer.estimator={est}",) if policy == "seer" else ()
        exact = simulate(_cfg(*base, *opt, "--config.cluster.macro_steps=1"), policy)
        macro = simulate(_cfg(*base, *opt, "--config.cluster.macro_steps=64"), policy)
        assert macro.driver_steps < exact.driver_steps / 5
        assert macro.report.makespan_s == pytest.approx(exact.report.makespan_s, rel=1e-3)
        assert macro.iterations == pytest.approx(exact.iterations, rel=0.01)
    # seer's posterior estimator reads the running requests' in-flight progress when it refits
    # (Policy.wants_progress); a macro step reports progress only at its end, up to 64 tokens
    # later, so its fits see other censoring points and on a workload this small the schedule
    # moves (10% here). With progress reads off it is exact again:
    from seer_jax.rollout.core.policies.seer import SeerPolicy

    monkeypatch.setattr(SeerPolicy, "wants_progress", lambda self: False)
    post = "--config.policy.seer.estimator=posterior"
    exact = simulate(_cfg(*base, post, "--config.cluster.macro_steps=1"), "seer")
    macro = simulate(_cfg(*base, post, "--config.cluster.macro_steps=64"), "seer")
    assert macro.iterations == exact.iterations
    assert macro.report.makespan_s == pytest.approx(exact.report.makespan_s, rel=1e-5)


def test_grouped_speculation_speeds_up_the_tail():
    c = _cfg("--config.workload.num_prompts=12")
    plain = simulate(c, "seer")
    spec = simulate(c, "seer", speculation=True)
    assert spec.report.output_tokens == plain.report.output_tokens
    assert spec.report.tokens_per_s > 1.1 * plain.report.tokens_per_s
    assert 0.0 < spec.report.spec_acceptance < 1.0
    assert plain.report.spec_acceptance is None
    # no speculation at all when every draft is rejected
    c0 = _cfg("--config.workload.num_prompts=12", "--config.spec.acceptance=[0.0]",
              "--config.spec.solo_acceptance=[0.0]")
    none = simulate(c0, "seer", speculation=True)
    assert none.report.spec_acceptance is None
    assert none.report.makespan_s == pytest.approx(plain.report.makespan_s, rel=1e-9)


def test_summary_ratios_and_ablation_labels():
    c = _cfg("--config.workload.num_prompts=12")
    runs = ablation(c)
    assert list(runs) == ["group_round_robin"] + [s[0] for s in sim.ABLATION_STEPS]
    summ = sim.summarize(runs)
    assert summ["group_round_robin"]["tokens_per_s_ratio_vs_group_round_robin"] == 1.0
    for row in summ.values():
        assert 0.0 <= row["tail_reduction_vs_group_round_robin"] <= 1.0
        assert 0.0 <= row["idle_fraction"] <= 1.0
        assert row["latency_p50_s"] <= row["latency_p90_s"] <= row["latency_p99_s"]


def test_sweep_shapes_and_icc_tracking():
    c = _cfg("--config.workload.num_prompts=8", "--config.sweep.iccs=[0.0, 0.9]",
             "--config.sweep.sigmas=[1.0]")
    out = sweep(c)
    assert np.asarray(out["gain"]["group_round_robin"]).shape == (1, 2)
    assert np.asarray(out["gain"]["request_fcfs"]).shape == (1, 2)
    lo, hi = out["cells"]
    assert lo["icc_measured"] < hi["icc_measured"]
    assert all(v > 0 for row in out["gain"]["group_round_robin"] for v in row)


@pytest.mark.parametrize(
    "override, match",
    [
        ("--config.cluster.hbm_gbps=-1.0", "cluster.hbm_gbps=-1.0"),
        ("--config.workload.max_tokens=0", "workload.max_tokens=0"),
        ("--config.cluster.accelerator='tpu-v9'", "unknown accelerator 'tpu-v9'"),
        ("--config.cluster.model='gpt-9'", "unknown model"),
        ("--config.policies='seer,fastest'", "policies='fastest' is invalid"),
        ("--config.cluster.pool_gbps=0.0", "cluster.pool_gbps"),
        ("--config.workload.icc=1.5", "workload.icc=1.5"),
        ("--config.cluster.profile_path='x.json'", "kv_capacity_tokens must be > 0"),
        ("--config.cluster.chips_per_instance=0", "chips_per_instance=0"),
    ],
)
def test_invalid_configs_raise_clear_errors(override, match):
    c = load_config_file(SMALL, [override])
    with pytest.raises(ConfigError, match=match):
        validate_config(c)


def test_weights_that_do_not_fit_are_a_config_error():
    c = load_config_file(SMALL, ["--config.cluster.model='qwen2-vl-72b'",
                                 "--config.cluster.accelerator='tpu-v5e'"])
    with pytest.raises(ConfigError, match="does not fit"):
        validate_config(c)


def test_paper_presets_validate():
    for name in ("moonlight", "qwen2_vl_72b", "kimi_k2"):
        c = load_config_file(f"configs/sim/{name}.py")
        validate_config(c)
        assert c.workload.preset
    k2 = load_config_file("configs/sim/kimi_k2.py")
    assert k2.cluster.num_instances == 256
    assert k2.workload.num_prompts * k2.workload.group_size == 6400


def test_uneven_groups_rejected(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"group_id": "a", "prompt_len": 5, "output_len": 7}\n'
                 '{"group_id": "b", "prompt_len": 6, "output_len": 9}\n'
                 '{"group_id": "a", "prompt_len": 5, "output_len": 3}\n')
    c = _cfg(f"--config.workload.trace_path='{p}'")
    with pytest.raises(ConfigError, match="groups of different sizes"):
        simulate(c, "seer")


def test_dataclass_row_is_json_ready():

    run = simulate(_cfg("--config.workload.num_prompts=4"), "request_fcfs")
    json.dumps(run.row())
    assert dataclasses.is_dataclass(run)


def test_token_unit_coarse_graining_matches_exact_tokens():
    base = ("--config.workload.num_prompts=12", "--config.workload.max_tokens=4096",
            "--config.cluster.kv_capacity_tokens=30000")
    exact = simulate(_cfg(*base), "seer")
    coarse = simulate(_cfg(*base, "--config.cluster.token_unit=16"), "seer")
    assert coarse.report.output_tokens == exact.report.output_tokens
    assert coarse.report.makespan_s == pytest.approx(exact.report.makespan_s, rel=0.05)
    assert coarse.report.tokens_per_s == pytest.approx(exact.report.tokens_per_s, rel=0.05)
    assert coarse.driver_steps < exact.driver_steps
    with pytest.raises(ConfigError, match="token_unit"):
        validate_config(_cfg(*base[:1], "--config.workload.max_tokens=512",
                                 "--config.cluster.token_unit=64"))


def test_prompt_oracle_needs_a_synthetic_workload(tmp_path):
    c = _cfg("--config.workload.num_prompts=6")
    trace = tmp_path / "t.jsonl"
    write_trace(sim.build_workload(c), trace)
    c2 = _cfg("--config.workload.num_prompts=6", f"--config.workload.trace_path={trace}")
    with pytest.raises(ConfigError, match="seer_prompt_oracle.*only a synthetic simulator workload"):
        simulate(c2, "seer_prompt_oracle")


def _write_calibration(path, solo, group, by_finished,
                       buckets=((0, 0), (1, 2), (3, 5), (6, None))):
    from seer_jax.drafting.calibration import FORMAT

    def rates(r):
        return {"offered": list(r), "per_step": list(r), "steps": 1, "tried": [1] * len(r)}

    path.write_text(json.dumps({
        "format": FORMAT, "gamma_max": len(group), "solo": rates(solo), "group": rates(group),
        "group_by_finished": {"buckets": [list(b) for b in buckets],
                              "rates": [rates(r) for r in by_finished]},
        "source": {}}))
    return str(path)


def test_calibration_file_replaces_the_assumed_rates(tmp_path):
    hi = [0.9, 0.8, 0.8, 0.7]
    f = _write_calibration(tmp_path / "cal.json", [0.0], hi, [hi, hi, hi, hi])
    c = _cfg("--config.workload.num_prompts=12", f"--config.spec.calibration={f}")
    m = sim.spec_model(c)
    assert m.calibration.group == tuple(hi) and m.calibration.rates_for(4) == tuple(hi)
    plain = simulate(c, "seer")
    assumed = simulate(_cfg("--config.workload.num_prompts=12"), "seer", speculation=True)
    cal = simulate(c, "seer", speculation=True)
    assert cal.report.output_tokens == plain.report.output_tokens
    assert cal.report.tokens_per_s > assumed.report.tokens_per_s > plain.report.tokens_per_s
    # the simulated acceptance follows the file's rates (positions past 4 repeat 0.7), above
    # the assumed ones
    assert cal.report.spec_acceptance > assumed.report.spec_acceptance
    # nothing accepted before a sibling has finished, then everything: speculation only starts
    # once siblings finish (later, fewer requests), so less gain than accepting from the start
    f2 = _write_calibration(tmp_path / "late.json", [0.0], hi,
                            [[0.0], [1.0], [1.0], [1.0]])
    late = simulate(_cfg("--config.workload.num_prompts=12", f"--config.spec.calibration={f2}"),
                    "seer", speculation=True)
    f3 = _write_calibration(tmp_path / "early.json", [0.0], hi, [[1.0]] * 4)
    early = simulate(_cfg("--config.workload.num_prompts=12", f"--config.spec.calibration={f3}"),
                     "seer", speculation=True)
    assert plain.report.tokens_per_s < late.report.tokens_per_s < early.report.tokens_per_s
    # every draft rejected: no speculation at all, the plain run
    f0 = _write_calibration(tmp_path / "zero.json", [0.0], [0.0], [[0.0]] * 4)
    none = simulate(_cfg("--config.workload.num_prompts=12", f"--config.spec.calibration={f0}"),
                    "seer", speculation=True)
    assert none.report.spec_acceptance is None
    assert none.report.makespan_s == pytest.approx(plain.report.makespan_s, rel=1e-9)


def test_bad_calibration_files_name_the_key(tmp_path):
    def check(path, match):
        c = load_config_file(SMALL, [f"--config.spec.calibration={path}"])
        with pytest.raises(ConfigError, match=match):
            validate_config(c)

    check(tmp_path / "missing.json", r"spec\.calibration=.*missing\.json.*no such file")
    (tmp_path / "junk.json").write_text("{not json")
    check(tmp_path / "junk.json", r"spec\.calibration=.*not a JSON file")
    (tmp_path / "other.json").write_text('{"rates": [0.5]}')
    check(tmp_path / "other.json", r"spec\.calibration=.*not a calibration file")
    f = _write_calibration(tmp_path / "range.json", [0.5], [1.5], [[0.5]] * 4)
    check(f, r"spec\.calibration=.*group\.per_step must be a non-empty list of rates in \[0, 1\]")
    f = _write_calibration(tmp_path / "buckets.json", [0.5], [0.5], [[0.5]] * 3)
    check(f, r"spec\.calibration=.*as many rates as buckets")
