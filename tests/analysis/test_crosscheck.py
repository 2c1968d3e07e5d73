import pytest

from seer_jax.analysis import crosscheck
from seer_jax.sim import simulator as sim
from seer_jax.sim.workloads import LengthModel, synthetic_workload, write_trace


def test_trace_replay_and_calibrated_prediction(tmp_path):
    from seer_jax.costs import (
        RooflineCostModel,
        get_accelerator,
        get_model,
        profile_from_cost_model,
    )

    work = synthetic_workload(LengthModel(10, 4, 800, truncated_fraction=0.1, min_tokens=4), 3)
    trace = tmp_path / "trace.jsonl"
    write_trace(work, trace)
    roof = RooflineCostModel(get_model("smollm2"), get_accelerator("h100"))
    prof = tmp_path / "profile.json"
    profile_from_cost_model(roof, batch_sizes=(1, 4, 16, 64), gammas=(0,),
                            context_tokens=(128, 1024)).save(prof)
    pred = crosscheck.predict_from_trace(str(trace), str(prof), policies=["seer", "group_round_robin"],
                                  num_instances=2, kv_capacity_tokens=20000, chunk_size=256)
    for p in ("seer", "group_round_robin"):
        assert pred[p]["output_tokens"] == int(work.output_len.sum())
        assert pred[p]["tokens_per_s"] > 0 and pred[p]["makespan_s"] > 0
    # the calibrated model predicts what the roofline it was sampled from gives (within 10%)
    c = crosscheck.calibrated_config(str(trace), None, num_instances=2, kv_capacity_tokens=20000,
                              chunk_size=256, accelerator="h100", chips_per_instance=1)
    assert c.cluster.profile_path == "" and c.cluster.kv_capacity_tokens == 20000
    roof_run = sim.simulate(c, "seer")
    assert pred["seer"]["makespan_s"] == pytest.approx(roof_run.report.makespan_s, rel=0.10)
