"""Token sampling shared by the reference generator and the engine.

Per-request randomness: the key for a request's n-th generated token is
`fold_in(PRNGKey(seed), n)`, so a request's samples depend only on its seed and its position,
never on batch composition, chunking, or which instance runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seer_jax.model.sampling_acceptance import sampling_log_probs
from seer_jax.model.sampling_params import FinishReason, SamplingParams  # noqa: F401


def request_keys(seeds_b: jax.Array, step_b: jax.Array) -> jax.Array:
    """Raw PRNG keys [B, 2] uint32 for generated-token index `step_b` of each request."""
    base = jax.vmap(jax.random.PRNGKey)(seeds_b.astype(jnp.uint32))
    return jax.vmap(jax.random.fold_in)(base, step_b.astype(jnp.uint32))


def sample_tokens(
    logits_bv: jax.Array,
    keys_b2: jax.Array,
    temperature_b: jax.Array,
    top_p_b: jax.Array,
    top_k_b: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row. Returns (tokens [B] int32, logprobs [B] float32).

    Greedy rows (temperature 0) take argmax and report the raw log-softmax; sampled rows report
    the log-probability under the temperature-scaled, top-k/top-p filtered distribution. The
    distribution is `seer_jax.model.sampling_acceptance.sampling_log_probs`, the one speculative acceptance uses.
    """
    greedy = temperature_b <= 0
    logp = sampling_log_probs(logits_bv, temperature_b, top_p_b, top_k_b)
    sampled = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys_b2, logp)
    tokens = jnp.where(greedy, jnp.argmax(logp, axis=-1), sampled).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def top_logprobs(logits_bv: jax.Array, temperature_b: jax.Array, top_p_b: jax.Array,
                 top_k_b: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The n most likely tokens and their log-probs under the same distribution as sample_tokens."""
    logp = sampling_log_probs(logits_bv, temperature_b, top_p_b, top_k_b)
    vals, idx = jax.lax.top_k(logp, n)
    return idx.astype(jnp.int32), vals
