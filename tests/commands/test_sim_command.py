"""`seer-jax simulate`: table, ablation, sweep, plots and JSON summary."""

import json

from seer_jax.cli import main


def _png_ok(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_simulate_cli_ablation_plots_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    plots = tmp_path / "plots"
    rc = main(["simulate", "--config", "configs/sim/small.py", "--config.workload.num_prompts=12",
               "--ablation", "--plots", str(plots), "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "policies vs group_round_robin" in text and "ablation" in text
    d = json.loads(out.read_text())
    s = d["summary"]
    for pol in ("seer", "group_round_robin", "request_fcfs", "oracle_lfs"):
        row = s["policies"][pol]
        for key in ("tokens_per_s", "makespan_s", "tail_s",
                    "tokens_per_s_ratio_vs_group_round_robin",
                    "tail_reduction_vs_group_round_robin"):
            assert isinstance(row[key], float), (pol, key)
    assert set(s["ablation"]) == {"divided (request_fcfs)", "+ context (seer)",
                                  "+ grouped SD (seer + spec)"}
    assert isinstance(s["ablation_order_ok"], bool)
    assert 0 < s["seer_tokens_per_s_ratio_vs_oracle_lfs"]
    for name in ("latency_cdf.png", "tokens_in_flight.png", "timeline_seer.png",
                 "timeline_group_round_robin.png", "ablation.png"):
        _png_ok(plots / name)


def test_simulate_cli_sweep(tmp_path):
    out = tmp_path / "sweep.json"
    rc = main(["simulate", "--config", "configs/sim/small.py", "--config.workload.num_prompts=8",
               "--compare", "seer,group_round_robin", "--sweep",
               "--config.sweep.iccs=[0.0, 0.9]", "--config.sweep.sigmas=[0.8]",
               "--plots", str(tmp_path), "--json", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert len(d["sweep"]["cells"]) == 2
    assert len(d["summary"]["sweep_gain"]["group_round_robin"][0]) == 2
    _png_ok(tmp_path / "sweep.png")


def test_simulate_cli_bad_config_is_one_clear_error(capsys):
    rc = main(["simulate", "--config", "configs/sim/small.py", "--config.cluster.hbm_gbps=-5.0"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "cluster.hbm_gbps=-5.0" in err and "Traceback" not in err
    rc = main(["simulate", "--config", "configs/sim/small.py", "--compare", "seer,magic"])
    assert rc == 2
    assert "config.policies='magic' is invalid" in capsys.readouterr().err
