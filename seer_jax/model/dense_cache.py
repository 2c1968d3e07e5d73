"""Dense KV cache attention backend: the simple, obviously-right path used by the reference
generator and by full-sequence forward passes.

Cache: (k, v) each [num_layers, B, S, num_kv_heads, head_dim]. Tokens are laid out [B, T]
flattened; `attn_meta` is the positions array [B, T]. A query at position p attends to the
cache positions 0..p of its own row (causal; rows are right-padded, padding never attended).

Multi-head latent attention (`cfg.mla`): the cache is (latent,) [num_layers, B, S, kv_lora_rank +
qk_rope_head_dim], one row per token shared by every head, and `dense_mla_attention` attends in
the absorbed form. `attention_for(cfg)` picks the backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seer_jax.model import mla
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import AttentionFn, jnp_dtype


def init_dense_cache(cfg: ModelConfig, batch: int, seq_len: int) -> tuple[jax.Array, ...]:
    if cfg.mla is not None:
        return (jnp.zeros((cfg.num_layers, batch, seq_len, cfg.mla.cache_width), jnp_dtype(cfg)),)
    shape = (cfg.num_layers, batch, seq_len, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, jnp_dtype(cfg)), jnp.zeros(shape, jnp_dtype(cfg))


def dense_attention(cache, positions_bt, layer, q_nhd, k_nkd, v_nkd):
    k_cache, v_cache = cache
    B, T = positions_bt.shape
    _, _, S, K, D = k_cache.shape
    H = q_nhd.shape[1]
    G = H // K
    rows = jnp.arange(B)[:, None]
    k_cache = k_cache.at[layer, rows, positions_bt].set(k_nkd.reshape(B, T, K, D).astype(k_cache.dtype))
    v_cache = v_cache.at[layer, rows, positions_bt].set(v_nkd.reshape(B, T, K, D).astype(v_cache.dtype))
    keys = k_cache[layer].astype(jnp.float32)  # [B, S, K, D]
    values = v_cache[layer].astype(jnp.float32)
    q = q_nhd.reshape(B, T, K, G, D).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, keys) / jnp.sqrt(jnp.float32(D))
    mask = jnp.arange(S)[None, None, :] <= positions_bt[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values)
    return out.reshape(B * T, H, D).astype(q_nhd.dtype), (k_cache, v_cache)


def dense_mla_attention(cache, positions_bt, layer, q_latent, q_rope, c_kv, k_rope, *, sm_scale):
    """Absorbed MLA over the dense latent cache: stores rows [c_kv [N, r], k_rope [N, dr]],
    attends q_latent [N, H, r] / q_rope [N, H, dr] causally -> [N, H, r] float32."""
    (latent,) = cache
    B, T = positions_bt.shape
    r = q_latent.shape[-1]
    rows = jnp.concatenate([c_kv, k_rope], axis=-1)
    latent = latent.at[layer, jnp.arange(B)[:, None], positions_bt].set(
        rows.reshape(B, T, -1).astype(latent.dtype))
    S = latent.shape[2]
    keys = latent[layer]  # [B, S, r + dr]
    mask = jnp.arange(S)[None, None, :] <= positions_bt[:, :, None]  # [B, T, S]
    out = jax.vmap(mla.latent_attention_reference, in_axes=(0, 0, 0, 0, 0, None))(
        q_latent.reshape(B, T, *q_latent.shape[1:]), q_rope.reshape(B, T, *q_rope.shape[1:]),
        keys[..., :r], keys[..., r:], mask, sm_scale)
    return out.reshape(B * T, *out.shape[2:]), (latent,)


def attention_for(cfg: ModelConfig) -> AttentionFn:
    """The dense-cache attention backend for this model."""
    if cfg.mla is not None:
        return functools.partial(dense_mla_attention, sm_scale=mla.softmax_scale(cfg))
    return dense_attention
