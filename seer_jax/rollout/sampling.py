"""Token sampling shared by the reference generator and the engine.

Per-request randomness: the key for a request's n-th generated token is
`fold_in(PRNGKey(seed), n)`, so a request's samples depend only on its seed and its position,
never on batch composition, chunking, or which instance runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def request_keys(seeds_b: jax.Array, step_b: jax.Array) -> jax.Array:
    """Raw PRNG keys [B, 2] uint32 for generated-token index `step_b` of each request."""
    base = jax.vmap(jax.random.PRNGKey)(seeds_b.astype(jnp.uint32))
    return jax.vmap(jax.random.fold_in)(base, step_b.astype(jnp.uint32))


def filter_logits(
    logits_bv: jax.Array, temperature_b: jax.Array, top_p_b: jax.Array, top_k_b: jax.Array
) -> jax.Array:
    """Temperature-scaled logits with top-k / top-p filtered entries set to -inf.

    Rows with temperature 0 are returned unscaled (the caller takes argmax).
    """
    logits = logits_bv.astype(jnp.float32)
    t = jnp.where(temperature_b > 0, temperature_b, 1.0)[:, None]
    scaled = logits / t
    V = scaled.shape[-1]

    def filtered(scaled):
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        k = jnp.where(top_k_b > 0, jnp.minimum(top_k_b, V), V)
        kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
        sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        cum_before = jnp.cumsum(probs, axis=-1) - probs
        keep = (cum_before < top_p_b[:, None]) & jnp.isfinite(sorted_desc)
        keep = keep.at[:, 0].set(True)
        threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(scaled >= threshold, scaled, -jnp.inf)

    needs = jnp.any((top_k_b > 0) | (top_p_b < 1.0))
    return jax.lax.cond(needs, filtered, lambda s: s, scaled)


def sample_tokens(
    logits_bv: jax.Array,
    keys_b2: jax.Array,
    temperature_b: jax.Array,
    top_p_b: jax.Array,
    top_k_b: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. Returns (tokens [B] int32, logprobs [B] float32).

    Greedy rows (temperature 0) take argmax and report the raw log-softmax; sampled rows report
    the log-probability under the temperature-scaled, top-k/top-p filtered distribution.
    """
    greedy = temperature_b <= 0
    raw_logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    filtered = filter_logits(logits_bv, temperature_b, top_p_b, top_k_b)
    samp_logp = jax.nn.log_softmax(filtered, axis=-1)
    sampled = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys_b2, filtered)
    argmax = jnp.argmax(raw_logp, axis=-1)
    tokens = jnp.where(greedy, argmax, sampled).astype(jnp.int32)
    logp = jnp.where(greedy[:, None], raw_logp, samp_logp)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def top_logprobs(logits_bv: jax.Array, temperature_b: jax.Array, top_p_b: jax.Array,
                 top_k_b: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The n most likely tokens and their log-probs under the same distribution as sample_tokens."""
    greedy = (temperature_b <= 0)[:, None]
    raw_logp = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    samp_logp = jax.nn.log_softmax(filter_logits(logits_bv, temperature_b, top_p_b, top_k_b), axis=-1)
    logp = jnp.where(greedy, raw_logp, samp_logp)
    vals, idx = jax.lax.top_k(logp, n)
    return idx.astype(jnp.int32), vals
