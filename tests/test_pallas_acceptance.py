"""Draft acceptance: greedy equals a Python loop; sampling is lossless (chi-square)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.errors import InputError
from seer_jax.pallas import accept_draft_tree, sampling_log_probs, verify_tree_parents


def _greedy_loop(tokens, parents, n_draft, logits):
    cur, path, out = -1, [], []
    while True:
        target = int(np.argmax(logits[cur + 1]))
        kids = [j for j in range(n_draft) if parents[j] == cur and tokens[j] == target]
        out.append(target)
        if not kids:
            return path, out
        cur = kids[0]
        path.append(cur)


def test_greedy_matches_python_loop():
    rng = np.random.default_rng(1)
    s, n, vocab = 6, 7, 5
    parents = np.array([[-1, 0, 0, 1, 2, 2, 4]] * 3 + [[-1, 0, 1, 2, 3, 4, 5]] * 3, np.int32)
    num = np.array([7, 4, 0, 7, 3, 7], np.int32)
    for trial in range(5):
        logits = rng.normal(size=(s, n + 1, vocab)).astype(np.float32)
        tokens = rng.integers(0, vocab, size=(s, n)).astype(np.int32)
        # Make some drafts right so paths get long.
        for i in range(s):
            for j in range(n):
                if rng.random() < 0.7:
                    tokens[i, j] = np.argmax(logits[i, parents[i, j] + 1])
        res = accept_draft_tree(
            jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(num), jnp.asarray(logits),
            jnp.zeros(s), jnp.ones(s), jnp.zeros(s, jnp.int32),
            jax.random.split(jax.random.key(trial), s),
        )
        raw = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
        for i in range(s):
            path, out = _greedy_loop(tokens[i], parents[i], num[i], logits[i])
            assert int(res.num_accepted[i]) == len(path)
            assert np.asarray(res.accepted_nodes[i, : len(path)]).tolist() == path
            assert np.all(np.asarray(res.accepted_nodes[i, len(path):]) == -1)
            assert np.asarray(res.tokens[i, : len(out)]).tolist() == out
            assert int(res.next_token[i]) == out[-1]
            rows = [-1] + path
            want = [raw[i, r + 1, t] for r, t in zip(rows, out, strict=True)]
            np.testing.assert_allclose(np.asarray(res.logprobs[i, : len(out)]), want, atol=1e-6)


def test_verify_tree_parents():
    p = verify_tree_parents(jnp.array([[-1, 0, 0, 2]], jnp.int32))
    assert np.asarray(p).tolist() == [[-1, 0, 1, 1, 3]]


def test_sampling_log_probs_filters():
    logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
    lp = np.exp(np.asarray(sampling_log_probs(logits, jnp.ones(1), jnp.ones(1), jnp.array([2]))))
    np.testing.assert_allclose(lp, [[2 / 3, 1 / 3, 0, 0]], atol=1e-6)
    lp = np.exp(np.asarray(sampling_log_probs(logits, jnp.ones(1), jnp.array([0.7]),
                                              jnp.zeros(1, jnp.int32))))
    np.testing.assert_allclose(lp, [[2 / 3, 1 / 3, 0, 0]], atol=1e-6)
    lp = np.exp(np.asarray(sampling_log_probs(logits, jnp.array([0.5]), jnp.ones(1),
                                              jnp.zeros(1, jnp.int32))))
    want = np.array([0.5, 0.25, 0.15, 0.1]) ** 2
    np.testing.assert_allclose(lp, [want / want.sum()], atol=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(InputError, match="target_logits"):
        accept_draft_tree(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32),
                          jnp.zeros(2, jnp.int32), jnp.zeros((2, 3, 5)), jnp.zeros(2),
                          jnp.ones(2), jnp.zeros(2, jnp.int32),
                          jax.random.split(jax.random.key(0), 2))
