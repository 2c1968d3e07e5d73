"""Reference generator: the oracle must itself be right."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.errors import InputError
from seer_jax.model.config import tiny_config
from seer_jax.model.generate import full_forward, generate
from seer_jax.model.llama import init_params
from seer_jax.model.sampling_acceptance import sampling_log_probs
from seer_jax.rollout.core.types import SamplingParams

CFG = tiny_config(eos_token_ids=())
PARAMS = init_params(CFG, seed=11)
PROMPTS = [[5, 9, 13, 200, 7], [1, 2], [100, 101, 102, 103, 104, 105, 106, 107, 108]]


def test_greedy_equals_recomputed_argmax_and_logprobs():
    gens = generate(PARAMS, CFG, PROMPTS, 12)
    for p, g in zip(PROMPTS, gens, strict=True):
        seq = np.array([p + g.token_ids])
        logits = np.asarray(full_forward(PARAMS, CFG, seq))[0]
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        for j, t in enumerate(g.token_ids):
            row = len(p) - 1 + j
            assert t == int(np.argmax(logits[row]))
            assert abs(g.logprobs[j] - logp[row, t]) < 1e-4
        assert g.finish_reason == "length"


def test_seeded_sampling_reproducible_and_batch_independent():
    s = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    a = generate(PARAMS, CFG, PROMPTS, 10, s)
    b = generate(PARAMS, CFG, PROMPTS[1:2], 10, s[1])
    c = generate(PARAMS, CFG, PROMPTS, 10, s)
    assert a[1].token_ids == b[0].token_ids
    assert [g.token_ids for g in a] == [g.token_ids for g in c]
    d = generate(PARAMS, CFG, PROMPTS, 10, [SamplingParams(temperature=1.0, seed=i + 100) for i in range(3)])
    assert [g.token_ids for g in a] != [g.token_ids for g in d]


def test_top_k_one_is_greedy():
    greedy = generate(PARAMS, CFG, PROMPTS, 8)
    topk1 = generate(PARAMS, CFG, PROMPTS, 8, SamplingParams(temperature=0.7, top_k=1, seed=3))
    assert [g.token_ids for g in greedy] == [g.token_ids for g in topk1]
    assert all(abs(lp) < 1e-6 for g in topk1 for lp in g.logprobs)  # one token left: prob 1


def test_sampling_distribution_top_p_top_k_temperature():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    f = np.asarray(sampling_log_probs(logits, jnp.array([1.0]), jnp.array([0.65]), jnp.array([0])))
    assert np.isfinite(f[0, :2]).all() and np.isneginf(f[0, 2:]).all()
    np.testing.assert_allclose(np.exp(f[0, :2]), [0.5 / 0.7, 0.2 / 0.7], rtol=1e-5)
    f = np.asarray(sampling_log_probs(logits, jnp.array([1.0]), jnp.array([1.0]), jnp.array([3])))
    assert np.isfinite(f[0, :3]).all() and np.isneginf(f[0, 3:]).all()
    f = np.asarray(sampling_log_probs(logits, jnp.array([2.0]), jnp.array([1.0]), jnp.array([0])))
    np.testing.assert_allclose(f, np.asarray(jax.nn.log_softmax(logits / 2)), rtol=1e-5)


def test_eos_and_stop_tokens_cut_output():
    g = generate(PARAMS, CFG, PROMPTS[:1], 12)[0]
    eos = g.token_ids[3]
    first = g.token_ids.index(eos)
    cut = generate(PARAMS, CFG, PROMPTS[:1], 12, eos_ids=(eos,))[0]
    assert cut.token_ids == g.token_ids[: first + 1] and cut.finish_reason == "eos"
    stop = generate(PARAMS, CFG, PROMPTS[:1], 12, SamplingParams(temperature=0.0, stop_token_ids=(eos,)))[0]
    assert stop.finish_reason == "stop" and stop.token_ids == cut.token_ids


@pytest.mark.parametrize("prompts, n, msg", [
    ([[]], 4, "prompt 0 is empty"),
    ([[1] * 1020], 8, "exceeds the model context"),
    ([[1, 999]], 4, "outside"),
    ([[1]], 0, "max_new_tokens"),
])
def test_bad_input(prompts, n, msg):
    with pytest.raises(InputError, match=msg):
        generate(PARAMS, CFG, prompts, n)
