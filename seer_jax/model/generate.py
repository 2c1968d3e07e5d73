"""Reference generator: dense KV cache, prefill + `lax.scan` decode.

This is the correctness oracle for the paged engine, so it is kept simple: prompts are
right-padded into one [B, T] batch, the whole generation is one jitted call, and sequences keep
generating after EOS (the host cuts them). Sampling uses `seer_jax.model.sampling`, so with the
same seeds the engine must produce the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from seer_jax.errors import InputError
from seer_jax.model.config import ModelConfig
from seer_jax.model.dense_cache import attention_for, init_dense_cache
from seer_jax.model.llama import Params, forward
from seer_jax.model.sampling import request_keys, sample_tokens
from seer_jax.model.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@dataclasses.dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"


def full_forward(params: Params, cfg: ModelConfig, tokens_bt: jax.Array) -> jax.Array:
    """Logits [B, T, vocab] (float32) of a right-padded batch, no cache reuse."""
    return _full_forward(params, cfg, jnp.asarray(tokens_bt, jnp.int32))


def full_routing(params: Params, cfg: ModelConfig, tokens_bt: jax.Array) -> jax.Array:
    """A mixture of experts' chosen expert ids [B, T, num_moe_layers, experts per token] (int32)
    of a right-padded batch: what a trainer's forward over the same tokens routes."""
    return _full_forward(params, cfg, jnp.asarray(tokens_bt, jnp.int32), routing=True)


@functools.partial(jax.jit, static_argnames=("cfg", "routing"))
def _full_forward(params, cfg, tokens_bt, routing=False):
    B, T = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = init_dense_cache(cfg, B, T)
    logits, _, ids = forward(params, cfg, tokens_bt.reshape(-1), positions.reshape(-1), cache,
                             positions, attention_for(cfg), return_routing=True)
    if routing:
        return ids.reshape(ids.shape[0], B, T, -1).transpose(1, 2, 0, 3)
    return logits.reshape(B, T, -1)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens"))
def _generate(params, cfg, tokens_bt, lens_b, seeds_b, temperature_b, top_p_b, top_k_b,
              max_new_tokens):
    B, T = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = init_dense_cache(cfg, B, T + max_new_tokens)
    last = jnp.arange(B) * T + lens_b - 1
    logits, cache = forward(params, cfg, tokens_bt.reshape(-1), positions.reshape(-1), cache,
                            positions, attention_for(cfg), logits_index=last)
    keys = request_keys(seeds_b, jnp.zeros_like(lens_b))
    tok, lp = sample_tokens(logits, keys, temperature_b, top_p_b, top_k_b)

    def step(carry, t):
        cache, tok = carry
        pos = (lens_b + t)[:, None]
        logits, cache = forward(params, cfg, tok, pos.reshape(-1), cache, pos,
                                attention_for(cfg))
        keys = request_keys(seeds_b, jnp.full_like(lens_b, t + 1))
        new_tok, new_lp = sample_tokens(logits, keys, temperature_b, top_p_b, top_k_b)
        return (cache, new_tok), (new_tok, new_lp)

    _, (toks, lps) = jax.lax.scan(step, (cache, tok), jnp.arange(max_new_tokens - 1))
    toks = jnp.concatenate([tok[None], toks], axis=0).T
    lps = jnp.concatenate([lp[None], lps], axis=0).T
    return toks, lps


def generate(
    params: Params,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingParams | list[SamplingParams] = GREEDY,
    eos_ids: tuple[int, ...] | None = None,
) -> list[Generation]:
    """Generate for each prompt; one SamplingParams for all or one per prompt."""
    if not prompts:
        return []
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if len(samplings) != len(prompts):
        raise InputError(f"got {len(samplings)} SamplingParams for {len(prompts)} prompts")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise InputError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model context of {cfg.max_position_embeddings}"
            )
        bad = [t for t in p if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InputError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}): {bad[:5]}")
    for s in samplings:
        s.validate(cfg.vocab_size)
    eos = tuple(cfg.eos_token_ids) if eos_ids is None else tuple(eos_ids)
    B = len(prompts)
    T = max(len(p) for p in prompts)
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    toks, lps = _generate(
        params, cfg, jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32),
        jnp.asarray([s.seed for s in samplings], jnp.uint32),
        jnp.asarray([s.temperature for s in samplings], jnp.float32),
        jnp.asarray([s.top_p for s in samplings], jnp.float32),
        jnp.asarray([s.top_k for s in samplings], jnp.int32),
        max_new_tokens=max_new_tokens,
    )
    toks, lps = np.asarray(toks), np.asarray(lps)
    out = []
    for i, p in enumerate(prompts):
        reason = "length"
        n = max_new_tokens
        for j, t in enumerate(toks[i]):
            if t in eos:
                reason, n = "eos", j + 1
                break
            if t in samplings[i].stop_token_ids:
                reason, n = "stop", j + 1
                break
        out.append(Generation(list(p), toks[i, :n].tolist(), lps[i, :n].tolist(), reason))
    return out
