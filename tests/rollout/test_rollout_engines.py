"""The controller on real engines over mesh slices: placement, chunking and migration never change
the output."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from seer_jax.analysis.policies import CATALOG, Hindsight
from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError
from seer_jax.model.generate import generate
from seer_jax.rollout.backends.engine_instance import make_engine_instances, slice_devices
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.config import default_config, validate_config
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams
from tests.rollout.tiny_rollout import CFG, ENGINE, GROUPS, PARAMS  # noqa: E402

pytestmark = pytest.mark.slow  # engines or a cluster: make test runs these, test-fast does not



@pytest.fixture(scope="module")
def reference():
    return generate(PARAMS, CFG, GROUPS, 30)


@pytest.mark.parametrize("policy", ["seer", pytest.param("group_round_robin", marks=pytest.mark.exhaustive),
                                    pytest.param("request_fcfs", marks=pytest.mark.exhaustive),
                                    pytest.param("oracle_lfs", marks=pytest.mark.exhaustive)])
def test_greedy_policies_token_identical_on_4x_tp2(policy, reference):
    pool = HostKVPool()
    instances = make_engine_instances(CFG, PARAMS, num_instances=4, tp=2, engine_config=ENGINE, pool=pool,
                                      record_steps=True)
    oracle = {f"g{g}/{j}": len(reference[g].token_ids) for g in range(len(GROUPS)) for j in range(3)}
    out = rollout(GROUPS, group_size=3, max_tokens=30, instances=instances,
                  sampling=SamplingParams(temperature=0.0),
                  policy=CATALOG.make(policy, Hindsight(true_lengths=oracle)), pool=pool,
                  config={"chunk_size": 8}, group_ids=[f"g{g}" for g in range(4)])
    assert len(out.results) == 12
    assert len({r.request_id for r in out.results}) == 12
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
        np.testing.assert_allclose(r.logprobs, reference[r.group_index].logprobs, atol=1e-4)
    if policy != "group_round_robin":
        assert out.report.chunks > 12  # requests really were divided into chunks
        assert out.report.kv_bytes_exported > 0  # ... with their KV in the pool between chunks
        assert len({i for r in out.results for i in r.instances}) == 4
    assert all(inst.engine.blocks.num_free + inst.engine.blocks.num_evictable() == 48 for inst in instances)
    # every executed step is logged (what calibrates the simulator to this run)
    rows = [row for inst in instances for row in inst.step_log]
    assert all(b >= 1 and p + d >= 1 and dt > 0 for b, p, d, _, dt in rows)
    assert len(rows) == sum(inst.engine.step_count for inst in instances)


def test_mesh_slicing():
    slices = slice_devices(4, 2)
    assert [len(s) for s in slices] == [2, 2, 2, 2]
    assert len({d.id for s in slices for d in s}) == len(jax.devices())
    with pytest.raises(ConfigError, match=r"num_instances \(3\) x tp \(2\) = 6 must equal the number of devices \(8\)"):
        slice_devices(3, 2)


@pytest.mark.parametrize("key, value, msg", [
    ("controller.chunk_size", 0, "config.controller.chunk_size=0"),
    ("controller.seer_quantile", 0.9, "unknown controller config key"),
    ("policies", "fastest", r"policies='fastest' is invalid; allowed: \['group_round_robin'"),
    ("policies", "oracle_lfs", "policies='oracle_lfs'"),  # analysis catalog only
    ("policy.seer.magic", 1, r"config.policy.seer: policy 'seer' has no option\(s\) \['magic'\]"),
    ("policy.request_fcfs", {"quantile": 0.9}, "config.policy.request_fcfs"),
    ("num_instances", 0, "num_instances=0"),
    ("time_model", "guess", "allowed: measured, roofline"),
])
def test_bad_rollout_config(key, value, msg):
    c = default_config()
    *parents, leaf = key.split(".")
    node = c
    for k in parents:
        node = node[k]
    with node.unlocked():
        node[leaf] = value
    with pytest.raises(ConfigError, match=msg):
        validate_config(c)


def test_analysis_catalog_accepts_oracles():
    c = default_config()
    c.policies = "seer,oracle_lfs"
    assert validate_config(c, CATALOG) == ["seer", "oracle_lfs"]


@pytest.mark.exhaustive  # speculation in process: tests/engine/test_speculative_engine.py; in a
# rollout on Ray actors: tests/rollout/test_ray_speculation.py (make test runs both)
def test_seer_with_grouped_speculation_token_identical(reference):
    from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
    from seer_jax.drafting.service import InProcessDraftService
    from seer_jax.engine.speculation import Speculator

    service = InProcessDraftService()  # one grouped draft server shared by both instances
    specs = [Speculator(service, SpeculationBudget(lambda b, g: 1.0, BudgetConfig(beta_init=0.9)))
             for _ in range(2)]
    pool = HostKVPool()
    engine_cfg = EngineConfig(num_pages=96, page_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                              max_prefill_seqs=2, speculation=True)
    instances = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=engine_cfg,
                                      pool=pool, devices=jax.devices()[:2], speculators=specs)
    out = rollout(GROUPS, group_size=3, max_tokens=30, instances=instances,
                  sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                  config={"chunk_size": 8})
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    assert out.report.spec_accepted > 0
    assert out.report.spec_accepted == sum(s.accepted for s in specs)
