"""Draft acceptance: greedy equals a Python loop; sampling is lossless (chi-square)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.errors import InputError
from seer_jax.model.sampling_acceptance import (
    _order_key,
    _radix_threshold,
    accept_draft_tree,
    sampling_log_probs,
    verify_tree_parents,
)


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


@pytest.mark.slow
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


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_threshold_search_is_exact_at_every_radix(bits):
    """The top-k and top-p thresholds, searched 1, 2, 4 or 8 bits per pass (CPU: 1,
    accelerators: 4), are the exact k-th largest value and the smallest value of the nucleus,
    ties, -inf, tiny and huge magnitudes included."""
    rng = np.random.RandomState(bits)
    for trial in range(12):
        v = int(rng.choice([5, 64, 999]))
        x = (rng.randn(4, v) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
        if trial % 3 == 0:
            x[:, : v // 2] = -np.inf
        if trial % 4 == 1:
            x = np.round(x)  # ties
        k = rng.randint(1, v // 2 + 2, (4, 1)).astype(np.int32)
        key = np.asarray(_order_key(jnp.asarray(x)))  # the float order (-0.0 below +0.0)
        tk = _radix_threshold(jnp.asarray(key),
                              lambda m, k=k: jnp.sum(m, -1, keepdims=True) >= k[..., None, :],
                              bits)
        want = np.sort(key, axis=-1)[:, ::-1][np.arange(4), k[:, 0] - 1]
        np.testing.assert_array_equal(want[:, None], tk)
        p = np.asarray(jax.nn.softmax(jnp.asarray(x), -1))
        top_p = rng.uniform(0.05, 0.99, (4, 1)).astype(np.float32)
        tp = _radix_threshold(
            _order_key(jnp.asarray(p)),
            lambda m, p=p, top_p=top_p: jnp.sum(jnp.where(m, p[..., None, :], 0.0), -1,
                                                keepdims=True) >= top_p[..., None, :], bits)
        for r in range(4):  # the largest t whose tokens >= t hold top_p of the mass
            ps = np.sort(p[r])[::-1]
            mass = np.array([p[r][p[r] >= t].sum(dtype=np.float32) for t in ps])
            want = ps[np.nonzero(mass >= top_p[r, 0])[0][0]]
            assert np.asarray(_order_key(jnp.asarray(want))) == tp[r, 0], (trial, r)


def test_bad_shapes_raise():
    with pytest.raises(InputError, match="target_logits"):
        accept_draft_tree(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32),
                          jnp.zeros(2, jnp.int32), jnp.zeros((2, 3, 5)), jnp.zeros(2),
                          jnp.ones(2), jnp.zeros(2, jnp.int32),
                          jax.random.split(jax.random.key(0), 2))


def _np_filtered_probs(logits, temperature, top_p, top_k):
    """Independent NumPy version of the sampling distribution (temperature, top-k, top-p)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    keep[order[:top_k]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    cum = 0.0
    keep2 = np.zeros(z.shape, bool)
    for i in order[:top_k]:
        if cum < top_p:
            keep2[i] = True
        cum += p[i]
    p = np.where(keep2, p, 0.0)
    return p / p.sum()


def _sample_many(tokens, parents, logits, n, temperature=0.7, top_p=0.9, top_k=4, seed=0):
    s = n
    res = accept_draft_tree(
        jnp.broadcast_to(jnp.asarray(tokens, jnp.int32), (s, len(tokens))),
        jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (s, len(tokens))),
        jnp.full((s,), len(tokens), jnp.int32),
        jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (s,) + logits.shape),
        jnp.full((s,), temperature), jnp.full((s,), top_p), jnp.full((s,), top_k, jnp.int32),
        jax.random.split(jax.random.key(seed), s),
    )
    return jax.tree.map(np.asarray, res)


def _chi2_ok(counts, probs):
    from scipy.stats import chisquare

    support = probs > 0
    assert counts[~support].sum() == 0, "emitted a token the target cannot produce"
    exp = probs[support] * counts.sum()
    assert exp.min() >= 5, "test needs more samples"
    return chisquare(counts[support], exp).pvalue


def _logits(rng, n_pos, vocab):
    return rng.normal(scale=1.5, size=(n_pos, vocab)).astype(np.float32)


@pytest.mark.parametrize(
    "tokens,parents,follow",
    [
        ([2, 0, 3], [-1, 0, 1], 0),  # chain: condition on accepting node 0, then its child
        ([2, 1, 2, 4, 0], [-1, -1, -1, 1, 1], 1),  # tree: dup sibling, branch under node 1
    ],
)
def test_sampling_is_lossless_chi_square(tokens, parents, follow):
    """Emitted tokens ~ target: first token ~ p(root); after accepting `follow`, the next token
    ~ p(follow); logprobs are the target's."""
    rng = np.random.default_rng(7)
    vocab, n = 6, 40000
    logits = _logits(rng, len(tokens) + 1, vocab)
    # Make the drafts plausible so acceptance happens often.
    logits[0, tokens[0]] += 1.0
    logits[0, tokens[1]] += 0.7
    res = _sample_many(tokens, parents, logits, n)
    probs = [_np_filtered_probs(logits[i], 0.7, 0.9, 4) for i in range(len(tokens) + 1)]
    first = res.tokens[:, 0]
    assert _chi2_ok(np.bincount(first, minlength=vocab), probs[0]) > 1e-3
    sel = res.num_accepted >= 1
    sel &= res.accepted_nodes[:, 0] == follow
    second = res.tokens[sel, 1]
    assert sel.sum() > 2000
    assert _chi2_ok(np.bincount(second, minlength=vocab), probs[follow + 1]) > 1e-3
    np.testing.assert_allclose(res.logprobs[:, 0], np.log(probs[0][first]), atol=1e-5)
    np.testing.assert_allclose(res.logprobs[sel, 1], np.log(probs[follow + 1][second]),
                               atol=1e-5)
    # Bookkeeping: emitted = accepted + 1, padded after.
    n_emit = res.num_accepted + 1
    assert np.all(res.tokens[np.arange(n), n_emit - 1] == res.next_token)
    assert np.all((res.tokens == -1) == (np.arange(len(tokens) + 1)[None] >= n_emit[:, None]))


def test_sampling_no_draft_equals_direct_sampling():
    rng = np.random.default_rng(8)
    logits = _logits(rng, 3, 6)
    res = _sample_many([1, 2], [-1, 0], logits, 20000, temperature=1.3, top_p=1.0, top_k=0)
    # Drafts cover node 0; the first emitted token must still follow p(root) exactly.
    probs = _np_filtered_probs(logits[0], 1.3, 1.0, 6)
    assert _chi2_ok(np.bincount(res.tokens[:, 0], minlength=6), probs) > 1e-3
