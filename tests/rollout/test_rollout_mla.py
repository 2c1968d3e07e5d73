"""A tiny random DeepSeek-V3 (multi-head latent attention over the paged latent cache, the
DeepSeek MoE block) through a divided rollout on 2 slices: requests split into chunks that
migrate through the KV pool (latent rows exported and imported), prompt prefixes shared, grouped
speculation verifying draft trees over the latent cache; the greedy tokens equal the dense
reference generator's."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.model.config import tiny_deepseek_config
from seer_jax.model.generate import generate
from seer_jax.model.llama import init_params
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams

pytestmark = pytest.mark.slow

CFG = tiny_deepseek_config(eos_token_ids=(7,))
PARAMS = init_params(CFG, seed=11)
GROUPS = [np.random.RandomState(0).randint(8, 256, n).tolist() for n in (5, 19, 11, 3)]


@pytest.mark.exhaustive  # 30-150 s on 2 cores (verify steps compiled for many tree shapes)
def test_divided_rollout_with_speculation_token_identical():
    from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
    from seer_jax.drafting.service import InProcessDraftService
    from seer_jax.engine.speculation import Speculator

    reference = generate(PARAMS, CFG, GROUPS, 30)
    service = InProcessDraftService()  # one grouped draft server shared by both slices
    specs = [Speculator(service, SpeculationBudget(lambda b, g: 1.0, BudgetConfig(beta_init=0.9)))
             for _ in range(2)]
    pool = HostKVPool()
    engine_cfg = EngineConfig(num_pages=96, page_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                              max_prefill_seqs=2, speculation=True)
    instances = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=engine_cfg,
                                      pool=pool, devices=jax.devices()[:2], speculators=specs)
    assert instances[0].engine.runner.kv_all.shape == (3, 96, 8, 40)  # latent rows
    out = rollout(GROUPS, group_size=3, max_tokens=30, instances=instances,
                  sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                  config={"chunk_size": 8})
    assert len(out.results) == 12
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    assert out.report.chunks > 12  # requests were divided into chunks ...
    assert out.report.kv_bytes_exported > 0  # ... with their latent rows in the pool between
    assert out.report.spec_accepted > 0  # draft trees verified over the latent cache
    assert len({i for r in out.results for i in r.instances}) == 2


def test_divided_rollout_token_identical():
    """Chunks of 6 tokens migrate between the 2 slices through the pool (latent rows)."""
    reference = generate(PARAMS, CFG, GROUPS[:2], 18)
    pool = HostKVPool()
    engine_cfg = EngineConfig(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=32,
                              max_prefill_seqs=2)
    instances = make_engine_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=engine_cfg,
                                      pool=pool, devices=jax.devices()[:2])
    out = rollout(GROUPS[:2], group_size=3, max_tokens=18, instances=instances,
                  sampling=SamplingParams(temperature=0.0), policy="seer", pool=pool,
                  config={"chunk_size": 6})
    assert len(out.results) == 6
    for r in out.results:
        assert r.token_ids == reference[r.group_index].token_ids, r.request_id
    assert out.report.chunks > 6 and out.report.kv_bytes_exported > 0
    assert len({i for r in out.results for i in r.instances}) == 2
