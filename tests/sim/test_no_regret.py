"""No regret from context: on the small simulator preset, over four workload seeds, `seer`'s
makespan is no longer than `request_fcfs`'s (the larger presets and the AIME trace halves are in
benchmarks/no_regret.py and docs/results.md)."""

import pytest

from seer_jax.analysis.policies import CATALOG
from seer_jax.config_files import load_config_file
from seer_jax.sim import simulator as sim


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_seer_makespan_no_longer_than_request_fcfs_on_small_preset(seed):
    cfg = load_config_file("configs/sim/small.py", [])
    sim.validate_config(cfg, CATALOG)  # the preset lists analysis policies too
    work = sim.build_workload(cfg, seed=seed)
    seer = sim.simulate(cfg, "seer", workload=work).report
    fcfs = sim.simulate(cfg, "request_fcfs", workload=work).report
    assert seer.output_tokens == fcfs.output_tokens == int(work.output_len.sum())
    assert seer.makespan_s <= fcfs.makespan_s * (1 + 1e-9), (seer.makespan_s, fcfs.makespan_s)
