"""Grouped speculative decoding in the engine: lossless (greedy exact, sampled in distribution),
logprobs equal to the non-speculative ones, real drafts from the group context accepted."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from seer_jax.drafting.budget import BudgetConfig, SpeculationBudget
from seer_jax.drafting.draft import Draft
from seer_jax.engine.engine import Engine, EngineConfig
from seer_jax.engine.speculation import Speculator
from seer_jax.model.config import tiny_config
from seer_jax.model.generate import full_forward, generate
from seer_jax.model.llama import init_params
from seer_jax.rollout.core.types import SamplingParams

pytestmark = pytest.mark.slow  # engines or a cluster: make test runs these, test-fast does not

CFG = tiny_config(eos_token_ids=())
PARAMS = init_params(CFG, seed=11)
RNG = np.random.RandomState(0)
PROMPTS = [RNG.randint(3, 256, 12).tolist(), RNG.randint(3, 256, 7).tolist()]
ENGINE = EngineConfig(num_pages=160, page_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                      speculation=True)


def always_on(max_width: int) -> SpeculationBudget:
    """A budget whose step time is flat in gamma: speculation always pays."""
    return SpeculationBudget(step_time=lambda b, g: 1.0,
                             config=BudgetConfig(beta_init=0.9, max_width=max_width))


class ScriptedService:
    """A draft service whose drafts come from a function of the request's tokens so far."""

    def __init__(self, make_draft):
        self.make_draft = make_draft
        self.tokens: dict[str, list[int]] = {}

    def append(self, group_id, request_id, token_ids):
        if request_id is not None:
            self.tokens.setdefault(request_id, []).extend(int(t) for t in token_ids)
        return 0

    def speculate(self, queries):
        return [self.make_draft(q.request_id, self.tokens.get(q.request_id, [])) for q in queries]


def run(engine, requests, arrive_every=5):
    out, step = {}, 0
    pending = list(requests)
    while pending or engine.has_unfinished():
        if pending and step % arrive_every == 0:
            rid, prompt, n, sp, group = pending.pop(0)
            engine.add_request(rid, prompt, n, sp, group_id=group)
        for r in engine.step():
            out[r.request_id] = r
        step += 1
    engine.blocks.check()
    return out


@pytest.mark.parametrize("width", [1, pytest.param(4, marks=pytest.mark.exhaustive)])
def test_group_drafts_greedy_identical_and_accepted(width):
    ref = generate(PARAMS, CFG, PROMPTS, 40)
    spec = Speculator(budget=always_on(width))
    eng = Engine(CFG, PARAMS, ENGINE, speculator=spec)
    reqs = [(f"{g}/{j}", PROMPTS[g], 40, SamplingParams(temperature=0.0), str(g))
            for j in range(4) for g in range(2)]
    out = run(eng, reqs)
    for rid, r in out.items():
        g = int(rid.split("/")[0])
        assert r.token_ids == ref[g].token_ids, rid
        np.testing.assert_allclose(r.logprobs, ref[g].logprobs, atol=1e-4)
    # siblings that start later draft from the first request's tokens: most of them are accepted
    assert spec.accepted > 0.5 * (8 * 40 - 2 * 40)
    assert sum(r.metrics.spec_accepted for r in out.values()) == spec.accepted
    assert eng.step_count < 8 * 40 / 2
    for r in out.values():
        # the prefill emits one token, each decode step 1 + its accepted drafts, except that the
        # last step's are cut at max_tokens
        m = r.metrics
        assert 0 <= 1 + m.decode_steps + m.spec_accepted - len(r.token_ids) <= 8, m
        assert m.decode_steps < len(r.token_ids) - 1


@pytest.mark.parametrize("mode", ["all_right", "all_wrong", "tree_second_branch"])
def test_forced_drafts_greedy_identical(mode):
    ref = generate(PARAMS, CFG, PROMPTS[:1], 30)[0].token_ids
    prompt_len = len(PROMPTS[0])

    def make_draft(rid, toks):
        done = len(toks)
        right = ref[done:done + 4]
        if not right:
            return Draft.empty()
        wrong = [(t + 1) % CFG.vocab_size for t in right]
        if mode == "all_right":
            return Draft.chain(right)
        if mode == "all_wrong":
            return Draft.chain(wrong)
        # a fork at the root: wrong branch first (rejected), right branch second
        n = len(right)
        tokens = [wrong[0]] + right
        parents = [-1, -1] + list(range(1, n))
        return Draft(np.array(tokens, np.int32), np.array(parents, np.int32), np.ones(n + 1, np.float32))

    spec = Speculator(ScriptedService(make_draft), always_on(4))
    eng = Engine(CFG, PARAMS, ENGINE, speculator=spec)
    out = run(eng, [("r", PROMPTS[0], 30, SamplingParams(temperature=0.0), "g")])["r"]
    assert out.token_ids == ref
    assert prompt_len > 0
    if mode == "all_wrong":
        assert spec.accepted == 0 and spec.proposed > 0
    else:
        assert spec.accepted >= 0.6 * 30
        assert eng.step_count <= 30 // 4 + 4


def test_sampled_distribution_and_logprobs_unchanged_by_speculation():
    """T=1: the distribution of the 2nd and 3rd tokens with drafts that are sometimes right and
    sometimes wrong equals non-speculative sampling (chi-square), and every logprob equals the
    full forward's log-softmax at the emitted token."""
    cfg = tiny_config(vocab_size=12, eos_token_ids=(), hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1)
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, init_params(cfg, seed=4))
    prompt = [1, 5, 7]
    n = 600
    greedy_next = generate(params, cfg, [prompt], 3)[0].token_ids

    def make_draft(rid, toks):  # right for the greedy path, wrong otherwise; a 2-way fork
        d = len(toks)
        guess = greedy_next[d:d + 2] if toks == greedy_next[:d] else [(sum(toks) + 3) % 12] * 2
        if not guess:
            return Draft.empty()
        alt = (guess[0] + 5) % 12
        return Draft(np.array(list(guess) + [alt], np.int32), np.array([-1, 0, -1][:len(guess)] + [-1], np.int32),
                     np.ones(len(guess) + 1, np.float32))

    def sample(with_spec):
        spec = Speculator(ScriptedService(make_draft), always_on(2)) if with_spec else None
        ec = EngineConfig(num_pages=4 * n, page_size=4, max_num_seqs=64, max_num_batched_tokens=256,
                          speculation=with_spec)
        eng = Engine(cfg, params, ec, speculator=spec)
        for i in range(n):
            eng.add_request(str(i), prompt, 3, SamplingParams(temperature=1.0, seed=1000 + i + (7919 * with_spec)))
        out = eng.run_until_done()
        return [out[str(i)] for i in range(n)], spec

    plain, _ = sample(False)
    spec_out, spec = sample(True)
    assert spec.accepted > 0 and spec.proposed > spec.accepted  # drafts both right and wrong
    for pos in (1, 2):
        a = np.bincount([r.token_ids[pos] for r in plain], minlength=12)
        b = np.bincount([r.token_ids[pos] for r in spec_out], minlength=12)
        keep = (a + b) > 0
        _, p, _, _ = stats.chi2_contingency(np.stack([a[keep], b[keep]]))
        assert p > 0.001, (pos, a, b)
    # logprobs are the target model's, at every emitted token
    seqs = np.array([prompt + r.token_ids for r in spec_out[:64]])
    logp = np.asarray(jax.nn.log_softmax(full_forward(params, cfg, seqs), axis=-1))
    for i, r in enumerate(spec_out[:64]):
        expect = [logp[i, len(prompt) - 1 + j, t] for j, t in enumerate(r.token_ids)]
        np.testing.assert_allclose(r.logprobs, expect, atol=1e-4)
