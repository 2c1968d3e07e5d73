"""Partial rollout across iterations on real engines (`EngineGroup.generate_groups_partial`, the
seam `SeerRollout.generate_partial` uses): two iterations with a weight sync between them."""

from __future__ import annotations

import pytest

from seer_jax.model.generate import generate
from seer_jax.model.llama import init_params
from seer_jax.rollout.core.types import SamplingParams
from tests.integrations.test_tunix import CFG, IDS, _group

pytestmark = pytest.mark.slow  # engines

GREEDY = SamplingParams(temperature=0.0)
MAX = 16


@pytest.mark.parametrize("sync", [True, False])
def test_carried_responses_finish_next_iteration_with_their_versions(sync):
    old, new = init_params(CFG, 0), init_params(CFG, 1)
    group = _group("api", params=old, controller_config={"chunk_size": 4, "max_in_flight_per_instance": 1})
    first = group.generate_groups_partial(IDS, 2, GREEDY, MAX, target_groups=1)
    done_first = {(r.group_id, r.sample_index) for r in first}
    assert 1 <= len({r.group_id for r in first}) < 3 and group.carry.unfinished_requests > 0
    carried = {(g.group_id, rec.request_id): list(rec.token_ids)
               for g in group.carry.groups for rec in g.records if rec.finish_reason is None}
    if sync:
        assert group.update_params(new) == 1
    second = group.generate_groups_partial([], 2, GREEDY, MAX, target_groups=0)
    assert len(group.carry) == 0
    done_second = {(r.group_id, r.sample_index) for r in second}
    assert not done_first & done_second  # none twice
    assert len(done_first | done_second) == 3 * 2  # none lost
    assert all(r.group_index == -1 for r in second)  # all of them carried groups
    ref_old = {tuple(p): w.token_ids for p, w in zip(IDS, generate(old, CFG, IDS, MAX, GREEDY,
                                                                   eos_ids=(2,)), strict=True)}
    for r in first:
        assert r.token_ids == ref_old[tuple(r.prompt_ids)]
        assert r.weight_versions == [[0, len(r.token_ids)]]
    mixed = 0
    for r in second:
        key = (r.group_id, f"{r.group_id}/{r.sample_index}")
        if key not in carried:  # finished in the first call, held back for its siblings
            assert r.token_ids == ref_old[tuple(r.prompt_ids)]
            assert r.weight_versions == [[0, len(r.token_ids)]]
            continue
        prefix = carried[key]
        assert r.token_ids[:len(prefix)] == prefix
        if not sync:  # same weights: the uninterrupted greedy response (KV from the pool)
            assert r.token_ids == ref_old[tuple(r.prompt_ids)]
            assert r.weight_versions == [[0, len(r.token_ids)]]
            continue
        # the rest is the new weights' greedy continuation of prompt + prefix (re-prefilled)
        cont = generate(new, CFG, [list(r.prompt_ids) + prefix], MAX - len(prefix), GREEDY,
                        eos_ids=(2,))[0].token_ids
        assert r.token_ids == prefix + cont
        want = [[0, len(prefix)], [1, len(cont)]] if prefix else [[1, len(cont)]]
        assert r.weight_versions == want
        mixed += bool(prefix)
        assert r.policy_version == 1
    assert mixed > 0 or not sync


def test_tunix_adapter_generate_partial_carries_groups_over_a_sync():
    pytest.importorskip("tunix")
    import jax
    import numpy as np
    from flax import nnx
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from seer_jax.engine.engine import EngineConfig
    from seer_jax.integrations.nnx_actor import TunixLlama
    from seer_jax.integrations.tunix import CharTokenizer, SeerRollout
    from tests.integrations.test_tunix import PROMPTS

    actor = TunixLlama(CFG, rngs=nnx.Rngs(params=0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("fsdp", "tp"))
    rc = RolloutConfig(data_parallel_size=2, tensor_parallel_size=1, max_tokens_to_generate=12,
                       seed=3)
    ro = SeerRollout(actor, CharTokenizer(), mesh, rc,
                     engine_config=EngineConfig(num_pages=64, page_size=8, max_num_seqs=16,
                                                max_num_batched_tokens=64, max_model_len=64),
                     controller_config={"chunk_size": 4, "max_in_flight_per_instance": 1})
    prompts = [p for p in PROMPTS for _ in range(2)]
    first = ro.generate_partial(prompts, rc, target_groups=1)
    assert ro.carried_groups > 0 and len(first) % 2 == 0
    ro.update_params(nnx.state(TunixLlama(CFG, rngs=nnx.Rngs(params=1)), nnx.Param))
    assert ro.policy_version == 1
    second = ro.generate_partial([], rc, target_groups=0)
    assert ro.carried_groups == 0
    keys = [(r.group_id, r.sample_index) for r in first + second]
    assert len(keys) == len(set(keys)) == len(prompts)  # every response once
    assert all(r.weight_versions == [[0, len(r.token_ids)]] for r in first)
    assert any(len(r.weight_versions) == 2 for r in second)  # spanned the sync
    assert all(sum(n for _, n in r.weight_versions) == len(r.token_ids) for r in second)
