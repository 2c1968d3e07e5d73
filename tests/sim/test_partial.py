"""Partial rollout across iterations in the simulator: every group started is returned once or
still carried, only carry-over returns off-policy tokens, and it hands out at least the batch."""

from __future__ import annotations

import pathlib

from seer_jax.config_files import load_config_file
from seer_jax.sim.partial import simulate_iterations

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs/sim/r1_aime.py"


def test_carry_over_against_waiting_for_every_group():
    cfg = load_config_file(str(CONFIG), ["--config.cluster.num_instances=2",
                                         "--config.cluster.token_unit=8"])
    runs = {co: simulate_iterations(cfg, "seer", iterations=4, groups_per_iteration=10,
                                    carry_over=co, oversubscription=1.5) for co in (False, True)}
    wait, carry = runs[False], runs[True]
    assert [r["new_groups"] for r in wait.iterations] == [10] * 4
    assert all(r["groups_returned"] == 10 and r["carried_groups"] == 0 for r in wait.iterations)
    assert wait.summary()["off_policy_share"] == 0.0
    assert carry.iterations[0]["new_groups"] == 15
    for r in carry.iterations:
        assert r["groups_returned"] >= 10
        assert r["groups_returned"] + r["carried_groups"] <= 15 + 15  # returned or still held
    started = sum(r["new_groups"] for r in carry.iterations)
    returned = sum(r["groups_returned"] for r in carry.iterations)
    assert returned + carry.iterations[-1]["carried_groups"] == started  # none lost or doubled
    s = carry.summary()
    assert s["carried_groups_at_end"] > 0 and 0 < s["off_policy_share"] < 1
    assert s["mean_age_of_off_policy_tokens"] >= 1 and s["reprefill_tokens"] > 0
