"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi-K2, Moonlight) in its absorbed form.

A token's keys and values are compressed into one latent per token and layer: `c_kv`
[kv_lora_rank] (after its RMSNorm) plus one RoPE key `k_rope` [qk_rope_head_dim] shared by
every head. That pair is all a cache holds: kv_lora_rank + qk_rope_head_dim values per token
and layer (576 for DeepSeek-V3) against 2 x heads x head_dim for multi-head attention.

Head h's key is [W_uk[h] c_kv, k_rope] and its value W_uv[h] c_kv, where `wkv_b` [r, H, dn + dv]
holds W_uk (the first dn columns of each head) and W_uv (the last dv). Attention never expands
them: the queries are multiplied into the latent space once (`absorb_queries`: q_latent[h] =
W_uk[h]^T q_nope[h]), so

    score(t, s, h) = q_latent[t, h] . c_kv[s] + q_rope[t, h] . k_rope[s]
    out_latent(t, h) = sum_s p(t, s, h) c_kv[s]

is attention with one key/value "head" shared by all query heads (the value is the latent
itself), and the value projection W_uv comes after (`unabsorb_output`). The paged kernels in
`seer_jax.pallas` attend over exactly this; `latent_attention_reference` is the dense form.

Positions use RoPE on the rope part only, with DeepSeek's YaRN scaling where configured:
interpolated frequencies with a ramp between `beta_fast` and `beta_slow` rotations, the cos/sin
scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim), and the softmax scale by
mscale(factor, mscale_all_dim)^2.

Parameter layout (inputs first, `x @ w`), per layer: `wq` [d, H*(dn+dr)] or, with a query
LoRA, `wq_a` [d, q_lora_rank], `q_a_norm` [q_lora_rank], `wq_b` [q_lora_rank, H*(dn+dr)];
`wkv_a` [d, r + dr], `kv_a_norm` [r], `wkv_b` [r, H*(dn+dv)], `wo` [H*dv, d].
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from seer_jax.model.config import ModelConfig


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's attention weights."""
    m = cfg.mla
    d, H, r = cfg.hidden_size, cfg.num_heads, m.kv_lora_rank
    shapes = {
        "wkv_a": (d, r + m.qk_rope_head_dim),
        "kv_a_norm": (r,),
        "wkv_b": (r, H * (m.qk_nope_head_dim + m.v_head_dim)),
        "wo": (H * m.v_head_dim, d),
    }
    if m.q_lora_rank is None:
        shapes["wq"] = (d, H * m.qk_head_dim)
    else:
        shapes.update({"wq_a": (d, m.q_lora_rank), "q_a_norm": (m.q_lora_rank,),
                       "wq_b": (m.q_lora_rank, H * m.qk_head_dim)})
    return shapes


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [qk_rope_head_dim // 2] float32, cos/sin scale)."""
    dim, base = cfg.mla.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    y = cfg.mla.yarn
    if y is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(base)))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (fast rotations)
    inv = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    if y.mscale and y.mscale_all_dim:
        scale = _yarn_mscale(y.factor, y.mscale) / _yarn_mscale(y.factor, y.mscale_all_dim)
    else:
        scale = _yarn_mscale(y.factor)
    return inv.astype(np.float32), float(scale)


def softmax_scale(cfg: ModelConfig) -> float:
    """The constant multiplying q.k: 1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2
    under YaRN (DeepSeek scales the non-rotary dims too)."""
    scale = cfg.mla.qk_head_dim ** -0.5
    y = cfg.mla.yarn
    if y is not None and y.mscale_all_dim:
        m = _yarn_mscale(y.factor, y.mscale_all_dim)
        scale *= m * m
    return scale


def rope_cos_sin(positions_n: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin [N, qk_rope_head_dim // 2] (one angle per rotated pair), YaRN-scaled."""
    inv, scale = rope_tables(cfg)
    ang = positions_n.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
    return jnp.cos(ang) * scale, jnp.sin(ang) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """Rotate x [N, ..., dr] (pairs interleaved, or halves with `interleave=False`); the
    rotated output is laid out in halves either way, as transformers lays it out."""
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# The query and latent RMSNorms' epsilon: fixed in DeepSeek's code and transformers, whatever
# the config's rms_norm_eps (which the decoder's own norms use)
LATENT_NORM_EPS = 1e-6


def _rms(x, w, eps):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def project_latent(h: jax.Array, lp: dict, cfg: ModelConfig, cos: jax.Array,
                   sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """What the cache stores for tokens h [N, d]: c_kv [N, r] (normalized) and k_rope [N, dr]
    (rotated)."""
    r = cfg.mla.kv_lora_rank
    ckv = h @ lp["wkv_a"]
    c, k_rope = ckv[:, :r], ckv[:, r:]
    c = _rms(c, lp["kv_a_norm"], LATENT_NORM_EPS)
    return c, apply_rope(k_rope, cos, sin, cfg.mla.rope_interleave)


def project_queries(h: jax.Array, lp: dict, cfg: ModelConfig, cos: jax.Array,
                    sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Queries of tokens h [N, d]: q_nope [N, H, dn] and q_rope [N, H, dr] (rotated)."""
    m = cfg.mla
    if m.q_lora_rank is None:
        q = h @ lp["wq"]
    else:
        q = _rms(h @ lp["wq_a"], lp["q_a_norm"], LATENT_NORM_EPS) @ lp["wq_b"]
    q = q.reshape(h.shape[0], cfg.num_heads, m.qk_head_dim)
    q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
    return q_nope, apply_rope(q_rope, cos, sin, m.rope_interleave)


def _wkv_b(lp: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """W_uk [r, H, dn] and W_uv [r, H, dv] out of wkv_b."""
    m = cfg.mla
    w = lp["wkv_b"].reshape(m.kv_lora_rank, -1, m.qk_nope_head_dim + m.v_head_dim)
    return w[..., :m.qk_nope_head_dim], w[..., m.qk_nope_head_dim:]


def absorb_queries(q_nope: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """q_latent [N, H, r] = W_uk[h]^T q_nope[h] (accumulated in float32)."""
    w_uk, _ = _wkv_b(lp, cfg)
    return jnp.einsum("nhk,rhk->nhr", q_nope, w_uk,
                      preferred_element_type=jnp.float32).astype(q_nope.dtype)


def unabsorb_output(o_latent: jax.Array, lp: dict, cfg: ModelConfig) -> jax.Array:
    """Attention output [N, H*dv] from its latent form o_latent [N, H, r] (W_uv after)."""
    _, w_uv = _wkv_b(lp, cfg)
    o = jnp.einsum("nhr,rhv->nhv", o_latent.astype(w_uv.dtype), w_uv,
                   preferred_element_type=jnp.float32)
    return o.reshape(o.shape[0], -1).astype(o_latent.dtype)


def latent_attention_reference(q_latent: jax.Array, q_rope: jax.Array, c_kv: jax.Array,
                               k_rope: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Dense absorbed attention: queries q_latent [N, H, r], q_rope [N, H, dr] over keys c_kv
    [S, r], k_rope [S, dr] where mask [N, S] is true; output [N, H, r] float32."""
    s = (jnp.einsum("nhr,sr->nhs", q_latent.astype(jnp.float32), c_kv.astype(jnp.float32))
         + jnp.einsum("nhd,sd->nhs", q_rope.astype(jnp.float32), k_rope.astype(jnp.float32)))
    s = jnp.where(mask[:, None, :], s * scale, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, :], p, 0.0)
    return jnp.einsum("nhs,sr->nhr", p, c_kv.astype(jnp.float32))


def attention_dense(h: jax.Array, lp: dict, cfg: ModelConfig, positions_n: jax.Array,
                    mask: jax.Array) -> jax.Array:
    """One MLA layer's attention over N tokens attending to each other where mask [N, N]
    allows (no cache): projections, absorbed attention, value and output projections.
    Returns [N, d]."""
    cos, sin = rope_cos_sin(positions_n, cfg)
    c, k_rope = project_latent(h, lp, cfg, cos, sin)
    q_nope, q_rope = project_queries(h, lp, cfg, cos, sin)
    o = latent_attention_reference(absorb_queries(q_nope, lp, cfg), q_rope, c, k_rope, mask,
                                   softmax_scale(cfg))
    return unabsorb_output(o.astype(h.dtype), lp, cfg) @ lp["wo"]


def hf_layer_tensors(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    """Our per-layer name -> (Hugging Face name under `model.layers.N.self_attn.`, transpose)."""
    names = {"wkv_a": ("kv_a_proj_with_mqa.weight", True), "kv_a_norm": ("kv_a_layernorm.weight", False),
             "wkv_b": ("kv_b_proj.weight", True), "wo": ("o_proj.weight", True)}
    if cfg.mla.q_lora_rank is None:
        names["wq"] = ("q_proj.weight", True)
    else:
        names.update({"wq_a": ("q_a_proj.weight", True), "q_a_norm": ("q_a_layernorm.weight", False),
                      "wq_b": ("q_b_proj.weight", True)})
    return names
