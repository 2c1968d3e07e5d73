"""Routed experts through the controller: a divided rollout of a tiny Qwen3-MoE over 2 slices with
experts sharded (tp/ep 2), chunks migrating between them, returns per generated token the expert
ids a full forward over prompt + response routes; so do speculative verify steps for every
accepted token; the journal keeps them for a resume."""

import jax
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import InputError
from seer_jax.model.config import tiny_config
from seer_jax.model.generate import full_routing
from seer_jax.model.llama import init_params
from seer_jax.model.moe_config import MoeConfig
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.core.journal import JournalWriter, RequestRecord, read_journal
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams

pytestmark = pytest.mark.slow  # engines: make test runs these, test-fast does not

MOE = MoeConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=16,
                norm_topk_prob=True)
CFG = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, moe=MOE, eos_token_ids=(7,))
PARAMS = init_params(CFG, seed=3)
GROUPS = [np.random.RandomState(0).randint(8, 256, n).tolist() for n in (5, 11)]


def _step_time(batch, prefill, decode, kv):
    return 1e-3 + 1e-4 * (prefill + decode)


def test_divided_rollout_routes_like_a_full_forward():
    pool = HostKVPool()
    engine = EngineConfig(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=16,
                          max_prefill_seqs=2, return_routed_experts=True)
    instances = make_engine_instances(CFG, PARAMS, num_instances=2, tp=2, engine_config=engine,
                                      pool=pool, devices=jax.devices()[:4], step_time=_step_time)
    # emulated clocks (no wall time): slice 1 runs 10x slower, so placement moves chunks off it
    instances[1].step_time = lambda *a: 10 * _step_time(*a)
    out = rollout(GROUPS, group_size=4, max_tokens=12, instances=instances,
                  sampling=SamplingParams(temperature=1.0, seed=5, return_routed_experts=True),
                  policy="seer", pool=pool, config={"chunk_size": 3, "balance_threshold": 0})
    assert sum(r.migrations for r in out.results) > 0  # chunks moved between the slices
    assert out.report.kv_bytes_imported > 0  # ... their KV through the pool, not recomputed
    for r in out.results:
        ids = np.asarray(r.routed_experts)
        assert ids.shape == (len(r.token_ids), 2, 2), r.request_id  # tokens, MoE layers, k
        seq = np.array([list(r.prompt_ids) + r.token_ids[:-1]])
        want = np.asarray(full_routing(PARAMS, CFG, seq))[0, len(r.prompt_ids) - 1:]
        assert np.array_equal(np.sort(ids, -1), np.sort(want, -1)), r.request_id


def test_journal_keeps_routed_experts(tmp_path):
    w = JournalWriter(tmp_path, {"k": 1})
    w.chunk_end("g0/0", 2, [4, 5], [-0.1, -0.2], 0, [[[1, 2]], [[3, 4]]])
    w.chunk_end("g0/1", 1, [6], [-0.3], 0)
    w.finished(RequestRecord("g1/0", [9], [-0.5], [[0, 1]], "eos", 1.0, 1, [[[0, 7]]]))
    w.close()
    reqs = read_journal(tmp_path).policy("").requests
    assert reqs["g0/0"].routed_experts == [[[1, 2]], [[3, 4]]]
    assert reqs["g0/1"].routed_experts is None
    assert reqs["g1/0"].routed_experts == [[[0, 7]]]
    # a record without routing cannot continue a rollout that returns it
    from seer_jax.rollout.core.policies import GroupState, RequestState
    from seer_jax.rollout.core.requests import restore_tokens

    req = RequestState("g0/1", GroupState("g0", 0, 8), 1, (1, 2),
                       SamplingParams(return_routed_experts=True), 8)
    with pytest.raises(InputError, match="routed experts"):
        restore_tokens(req, reqs["g0/1"], None)
    restore_tokens(req, reqs["g0/0"], None)
    assert req.routed_experts == [[[1, 2]], [[3, 4]]]


@pytest.mark.exhaustive  # ~30 s on 2 cores (the verify steps of a MoE model compile)
def test_speculative_verify_steps_route_every_accepted_token():
    """Drafts forking at the root (a wrong branch first, the greedy continuation second): the
    accepted path is compacted off tree nodes, and each accepted token's routing is the one at
    its node; the same as a full forward's, as without speculation."""
    from seer_jax.drafting.draft import Draft
    from seer_jax.engine.engine import Engine
    from seer_jax.engine.speculation import Speculator
    from seer_jax.model.generate import generate
    from tests.engine.test_speculative_engine import ScriptedService, always_on, run

    prompt = GROUPS[1]
    ref = generate(PARAMS, CFG, [prompt], 20, eos_ids=())[0].token_ids

    def make_draft(rid, toks):
        right = ref[len(toks):len(toks) + 3]
        if not right:
            return Draft.empty()
        n = len(right)
        return Draft(np.array([(right[0] + 1) % CFG.vocab_size] + right, np.int32),
                     np.array([-1, -1] + list(range(1, n)), np.int32), np.ones(n + 1, np.float32))

    spec = Speculator(ScriptedService(make_draft), always_on(4))
    engine = Engine(CFG, PARAMS, EngineConfig(num_pages=16, page_size=16, max_num_seqs=4,
                                              max_num_batched_tokens=32, speculation=True,
                                              return_routed_experts=True),
                    speculator=spec, eos_ids=())
    out = run(engine, [("r", prompt, 16, SamplingParams(temperature=0.0,
                                                        return_routed_experts=True), "g")])["r"]
    assert out.token_ids == ref[:16] and spec.accepted >= 8
    ids = np.asarray(out.routed_experts)
    want = np.asarray(full_routing(PARAMS, CFG, np.array([prompt + ref[:15]])))[0, len(prompt) - 1:]
    assert ids.shape == want.shape == (16, 2, 2)
    assert np.array_equal(np.sort(ids, -1), np.sort(want, -1))
