"""Partial rollout from the rollout config (`carry_over`, `target_groups`: validated, carried
across `run_rollout` calls) and on real in-process engines: carried requests continue from their
KV in the pool while the weights stay, and re-prefill after a weight sync."""

from __future__ import annotations

import os

import jax
import pytest

from seer_jax.errors import ConfigError
from seer_jax.rollout.api import run_rollout
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.config import default_config, validate_config
from seer_jax.rollout.core.carry import CarryOver
from seer_jax.rollout.core.run import rollout
from tests.rollout.carry_check import CONFIG, GREEDY, MAX, G, check_kv_reuse, reference, two_calls
from tests.rollout.test_resume import OVERRIDES, ROOT
from tests.rollout.tiny_rollout import CFG, ENGINE, PARAMS
from tests.subprocess_env import xla_flags_without_device_count


@pytest.mark.parametrize(("key", "value", "extra", "match"), [
    ("target_groups", -1, {"carry_over": True}, r"config\.target_groups=-1 is invalid: allowed: 0"),
    ("target_groups", True, {"carry_over": True}, r"config\.target_groups=True is invalid"),
    ("target_groups", 2, {}, r"config\.target_groups=2 is invalid: allowed: 0 unless carry_over=True"),
    ("journal_dir", "/tmp/j", {"carry_over": True},
     r"config\.journal_dir='/tmp/j' is invalid: allowed: '' with carry_over=True"),
    ("target_groups", 2, {"carry_over": True, "policies": "seer,group_round_robin"},
     r"config\.target_groups=2 is invalid: allowed: 0 with policy 'group_round_robin'"),
])
def test_bad_carry_over_settings_are_refused_naming_the_key(key, value, extra, match):
    c = default_config()
    for k, v in extra.items():
        c[k] = v
    c[key] = value
    with pytest.raises(ConfigError, match=match):
        validate_config(c)


def test_carry_over_defaults_off_and_valid_settings_pass():
    c = default_config()
    assert c.carry_over is False and c.target_groups == 0
    c.carry_over, c.target_groups = True, 3
    assert validate_config(c) == ["seer"]


def test_run_rollout_refuses_a_carry_it_would_drop():
    c = default_config()
    with pytest.raises(ConfigError, match=r"carry_over=False is invalid: the carried groups"):
        run_rollout(c, carry={"seer": CarryOver()})
    c.carry_over = True
    with pytest.raises(ConfigError, match=r"holds policies \['request_fcfs'\] that config"):
        run_rollout(c, carry={"request_fcfs": CarryOver()})
    with pytest.raises(ConfigError, match=r"allowed: the CarryOver of an earlier run"):
        run_rollout(c, carry={"seer": [1, 2]})


@pytest.mark.slow
@pytest.mark.parametrize("synced", [False, True])
def test_carried_requests_reuse_their_kv_unless_the_weights_changed(synced):
    pool = HostKVPool()
    insts = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                                  pool=pool, devices=jax.devices()[:2])

    def call(groups, carry, target, version):
        return rollout(groups, group_size=G, max_tokens=MAX, instances=insts, sampling=GREEDY,
                       policy="seer", pool=pool, config=CONFIG, carry=carry,
                       target_groups=target, weight_version=version)

    def sync():  # the same weights again, as a new version: what the carried KV is not
        for inst in insts:
            inst.engine.update_params(PARAMS)

    _, second, carried = two_calls(call, reference(), sync if synced else None)
    check_kv_reuse(second, carried, synced)


# runs in a process of its own: run_rollout asks for the CPU devices its instances need
RUN_TWICE = """
import json, sys
from seer_jax.config_files import load_config_file
from seer_jax.rollout.api import run_rollout

c = load_config_file(sys.argv[1], sys.argv[2:])
rows = lambda run: [[r.request_id, list(r.prompt_ids), r.token_ids]
                    for r in run.outputs["seer"].results]
whole = run_rollout(c)
c.carry_over, c.target_groups = True, 1
first = run_rollout(c)
carry = first.carry["seer"]
carried = [rec.request_id for g in carry.groups for rec in g.records]
summary = first.summary["carried_groups"]
c.target_groups = 0
second = run_rollout(c, carry=first.carry)
print(json.dumps({"whole": rows(whole), "first": rows(first), "second": rows(second),
                  "carried": carried, "summary": summary, "left": len(second.carry["seer"])}))
"""


@pytest.mark.slow
@pytest.mark.exhaustive  # two SmolLM2 rollouts in a subprocess; carrying on engines and on Ray:
# tests/integrations/test_carry_engines.py, tests/rollout/test_ray_carry.py (make test)
def test_run_rollout_carries_unfinished_groups_into_the_next_run():
    """From a config: the first run returns the complete groups and carries the rest; the next
    run (given that carry, target 0) returns the carried groups with its own, each request
    once, greedy tokens equal to an uninterrupted run's."""
    import json
    import subprocess
    import sys

    # the resume tests' rollout made greedy (every sample of a prompt then has the same tokens,
    # which the check below compares by prompt), one chunk in flight per instance so the first
    # group completes while the others are part-way
    proc = subprocess.run(
        [sys.executable, "-c", RUN_TWICE, os.path.join(ROOT, "configs/rollout/demo.py"),
         *OVERRIDES, "--config.temperature=0.0",
         "--config.controller.max_in_flight_per_instance=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "XLA_FLAGS": xla_flags_without_device_count(), "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = {tuple(p): t for _, p, t in out["whole"]}
    assert out["carried"] and out["summary"] == {"seer": len({r.split("/")[0] for r in out["carried"]})}
    assert out["left"] == 0
    got = out["first"] + out["second"]
    ids = [rid for rid, _, _ in got]
    assert len(ids) == len(set(ids)) == 2 * len(out["whole"])  # this run's groups, twice
    assert set(out["carried"]) <= set(ids)
    for rid, prompt, tokens in got:
        assert tokens == want[tuple(prompt)], rid
