"""Our decoder as the NNX module a trainer trains (Tunix's call signature), and its math.

Tunix calls the policy as `model(tokens_bt, positions=positions_bt, attention_mask=mask_btt,
cache=None)` and expects `(logits_btv, cache)`; prompts are left-padded, completions
right-padded, `positions` count non-pad tokens from 0 and `attention_mask[b, q, k]` says whether
query q may attend to key k. `TunixLlama` is our `Llama` parameter container (same parameter
paths, so weight sync is a name-for-name copy) with that `__call__`, running the shared
`seer_jax.model.llama.forward` with a dense masked attention backend: multi-head attention, or
for a model with multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) the absorbed
latent form the engines compute, so mixture-of-experts and latent-attention models train as
they are served. `TunixLlama.from_checkpoint` loads any checkpoint the engine loads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from seer_jax.model import mla
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Llama, Params, forward
from seer_jax.model.sampling_acceptance import sampling_log_probs
from seer_jax.model.sharding import ShardingRules, shard_params

_MASKED = -1e30  # finite: rows that see no key at all (left padding) stay NaN-free


def masked_attention(cache, mask_btt, layer, q_nhd, k_nkd, v_nkd):
    """Dense attention over a [B, T] batch flattened to N = B*T tokens, with an explicit mask."""
    B, T = mask_btt.shape[0], mask_btt.shape[1]
    H, K, D = q_nhd.shape[1], k_nkd.shape[1], q_nhd.shape[2]
    q = q_nhd.reshape(B, T, K, H // K, D).astype(jnp.float32)
    k = k_nkd.reshape(B, T, K, D).astype(jnp.float32)
    v = v_nkd.reshape(B, T, K, D).astype(jnp.float32)
    s = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(jnp.float32(D))
    s = jnp.where(mask_btt[:, None, None, :, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, v)
    return out.reshape(B * T, H, D).astype(q_nhd.dtype), cache


def masked_latent_attention(cache, mask_btt, layer, q_latent, q_rope, c_kv, k_rope, *, sm_scale):
    """Absorbed latent attention (`seer_jax.model.mla`) over a [B, T] batch flattened to N = B*T
    tokens, with an explicit mask: queries q_latent [N, H, r], q_rope [N, H, dr] against every
    token's latent c_kv [N, r] and k_rope [N, dr]; output [N, H, r] float32."""
    B, T = mask_btt.shape[0], mask_btt.shape[1]
    H = q_latent.shape[1]
    ql = q_latent.reshape(B, T, H, -1).astype(jnp.float32)
    qr = q_rope.reshape(B, T, H, -1).astype(jnp.float32)
    c = c_kv.reshape(B, T, -1).astype(jnp.float32)
    kr = k_rope.reshape(B, T, -1).astype(jnp.float32)
    s = jnp.einsum("bqhr,bsr->bhqs", ql, c) + jnp.einsum("bqhd,bsd->bhqs", qr, kr)
    s = jnp.where(mask_btt[:, None, :, :], s * sm_scale, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqs,bsr->bqhr", p, c)
    return out.reshape(B * T, H, -1), cache


def masked_forward(params: Params, cfg: ModelConfig, tokens_bt: jax.Array, positions_bt: jax.Array,
                   mask_btt: jax.Array) -> jax.Array:
    """Logits [B, T, vocab] float32 of a padded batch with explicit positions and mask."""
    B, T = tokens_bt.shape
    attention = masked_attention
    if cfg.mla is not None:
        attention = functools.partial(masked_latent_attention, sm_scale=mla.softmax_scale(cfg))
    logits, _ = forward(params, cfg, tokens_bt.reshape(-1), positions_bt.reshape(-1), None,
                        mask_btt.astype(bool), attention)
    return logits.reshape(B, T, -1)


def default_positions_and_mask(tokens_bt: jax.Array, pad_id: int | None = None):
    """Causal mask and 0-based positions; with pad_id, pads are masked and not counted."""
    B, T = tokens_bt.shape
    valid = jnp.ones((B, T), bool) if pad_id is None else tokens_bt != pad_id
    positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
    causal = jnp.tril(jnp.ones((T, T), bool))
    return positions, valid[:, None, :] & causal[None]


class TunixLlama(Llama):
    """`Llama` with the call signature Tunix's trainers and logprob helpers use (any model our
    `ModelConfig` describes: dense, mixture of experts, latent attention)."""

    @classmethod
    def from_params(cls, cfg: ModelConfig, params: Params, mesh: Mesh | None = None,
                    rules: ShardingRules = ShardingRules()) -> TunixLlama:
        """The module holding `params` (our nested dict), built without a random init. With a
        `mesh` (the trainer's, e.g. Tunix's ("fsdp", "tp") actor mesh) the weights are placed
        on it by `rules` (heads, MLP, vocabulary and experts over "tp" by default), and Tunix
        keeps that layout instead of replicating them."""
        params = jax.tree.map(jnp.asarray, params)
        if mesh is not None:
            params = shard_params(params, mesh, rules)
        model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
        model.set_params(params)
        return model

    @classmethod
    def from_checkpoint(cls, path: str, dtype: str = "float32", mesh: Mesh | None = None,
                        rules: ShardingRules = ShardingRules()) -> TunixLlama:
        """The module of a checkpoint `seer_jax.model.loading.load_model` reads (a Hugging Face
        safetensors directory, GGUF, Orbax), its weights in `dtype` (the trainer's), placed on
        `mesh` as `from_params` places them."""
        from seer_jax.model.loading import load_model

        cfg, params = load_model(path, dtype)
        return cls.from_params(cfg.with_dtype(dtype), params, mesh, rules)

    def __call__(self, input_tokens: jax.Array, positions: jax.Array | None = None,
                 cache=None, attention_mask: jax.Array | None = None):
        tokens = jnp.asarray(input_tokens, jnp.int32)
        if positions is None or attention_mask is None:
            pos, mask = default_positions_and_mask(tokens)
            positions = pos if positions is None else positions
            attention_mask = mask if attention_mask is None else attention_mask
        logits = masked_forward(self.params(), self.cfg, tokens, positions, attention_mask)
        return logits, None


@functools.partial(jax.jit, static_argnames=("cfg",))
def completion_logprobs(params: Params, cfg: ModelConfig, prompt_bp: jax.Array,
                        completion_bc: jax.Array, valid_bt: jax.Array, temperature_b: jax.Array,
                        top_p_b: jax.Array, top_k_b: jax.Array) -> jax.Array:
    """Log-probs [B, C] of the completion tokens under the sampling distribution the engine
    reports (temperature-scaled, top-k/top-p filtered; raw log-softmax where temperature is 0).

    prompt left-padded [B, P], completion right-padded [B, C]; valid_bt marks real tokens of the
    concatenation (Tunix's convention: positions and attention skip pads).
    """
    tokens = jnp.concatenate([prompt_bp, completion_bc], axis=1)
    B, T = tokens.shape
    C = completion_bc.shape[1]
    positions = jnp.maximum(jnp.cumsum(valid_bt, axis=-1) - 1, 0)
    mask = valid_bt[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None]
    logits = masked_forward(params, cfg, tokens, positions, mask)[:, T - C - 1:T - 1]
    per_token = lambda a: jnp.broadcast_to(a[:, None], (B, C))
    logp = sampling_log_probs(logits, per_token(temperature_b), per_token(top_p_b),
                              per_token(top_k_b))
    return jnp.take_along_axis(logp, completion_bc[..., None], axis=-1)[..., 0]
