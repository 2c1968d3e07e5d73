"""Llama-family decoder (Llama 2/3, Qwen2, Qwen3, SmolLM2) in Flax NNX.

The NNX module `Llama` owns the parameters (layer weights stacked on a leading `layers` axis so
the forward pass is one `lax.scan`, which keeps compile time flat in depth). A params dict may
instead hold its layers as a tuple of per-layer dicts (`split_layers`); `forward` then runs the
layers as an unrolled Python loop, each reading its own arrays. XLA:GPU copies each layer's
weights out of a stacked array before its GEMMs (a dynamic or static slice is a new buffer
there, read again by the GEMM), which adds up to three weight reads per layer to a decode step;
TPU fuses the slice into its matmuls. `resolve_layer_weights` picks per platform. The math lives in the
pure function `forward(params, cfg, tokens, positions, cache, attn_meta, attention)`, which takes
the parameters as a plain nested dict and a pluggable attention backend, so the same decoder runs
the dense reference generator (`seer_jax.model.dense_cache`) and the paged engine.

Token layout: a flat list of N tokens (`tokens_n`, `positions_n`). An attention backend is a
static callable `attention(cache, attn_meta, layer, q_nhd, k_nkd, v_nkd) -> (out_nhd, cache)` that
stores the new K/V in its cache and attends. With multi-head latent attention (`cfg.mla`,
`seer_jax.model.mla`) it is `attention(cache, attn_meta, layer, q_latent [N, H, r], q_rope
[N, H, dr], c_kv [N, r], k_rope [N, dr]) -> (out_latent [N, H, r], cache)`: it stores the tokens'
latent rows and attends in the absorbed form (one latent key/value shared by all heads).

Mixture-of-experts models (`cfg.moe`) replace a layer's dense MLP (w_gate/w_up/w_down) by the MoE
MLP of `seer_jax.model.moe` (router, experts, shared experts). A key's stacked leading axis counts
the layers that have it: every layer has the attention keys, the MoE layers the MoE keys, the
dense layers the dense MLP keys. A model whose layers mix both kinds runs each maximal run of
same-kind layers as its own scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seer_jax.errors import ConfigError
from seer_jax.model import mla
from seer_jax.model.config import LAYER_WEIGHTS, ModelConfig  # noqa: F401 (re-exported)
from seer_jax.model.moe import MOE_AXES, MOE_KEYS, moe_mlp, moe_shapes

Params = dict[str, Any]
AttentionFn = Callable[..., tuple[jax.Array, Any]]

# Logical axes of every parameter (leading "layers" on stacked layer weights).
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "layers/attn_norm": ("layers", "norm"),
    "layers/mlp_norm": ("layers", "norm"),
    "layers/wq": ("layers", "embed", "q_heads"),
    "layers/wk": ("layers", "embed", "kv_heads"),
    "layers/wv": ("layers", "embed", "kv_heads"),
    "layers/bq": ("layers", "q_heads"),
    "layers/bk": ("layers", "kv_heads"),
    "layers/bv": ("layers", "kv_heads"),
    "layers/q_norm": ("layers", "head_dim"),
    "layers/k_norm": ("layers", "head_dim"),
    "layers/wo": ("layers", "q_heads", "embed"),
    "layers/w_gate": ("layers", "embed", "mlp"),
    "layers/w_up": ("layers", "embed", "mlp"),
    "layers/w_down": ("layers", "mlp", "embed"),
    **{f"layers/{k}": ("layers", *axes) for k, axes in MOE_AXES.items()},
    # multi-head latent attention (wq and wo as above)
    "layers/wq_a": ("layers", "embed", None),
    "layers/q_a_norm": ("layers", None),
    "layers/wq_b": ("layers", None, "q_heads"),
    "layers/wkv_a": ("layers", "embed", None),
    "layers/kv_a_norm": ("layers", None),
    "layers/wkv_b": ("layers", None, "q_heads"),
}
DENSE_MLP_KEYS = frozenset({"w_gate", "w_up", "w_down"})


def key_kind(key: str) -> str | None:
    """Which layers hold a layer key: "dense" (MLP), "moe", or None (every layer)."""
    return "dense" if key in DENSE_MLP_KEYS else "moe" if key in MOE_KEYS else None


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every parameter, keyed like LOGICAL_AXES."""
    L, d, f, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers/attn_norm": (L, d),
        "layers/mlp_norm": (L, d),
    }
    if cfg.mla is not None:
        shapes.update({f"layers/{k}": (L, *shape) for k, shape in mla.layer_param_shapes(cfg).items()})
    else:
        shapes.update({"layers/wq": (L, d, cfg.q_size), "layers/wk": (L, d, cfg.kv_size),
                       "layers/wv": (L, d, cfg.kv_size), "layers/wo": (L, cfg.q_size, d)})
    kinds = cfg.layer_kinds
    num_dense = kinds.count("dense")
    if num_dense:
        shapes.update({"layers/w_gate": (num_dense, d, f), "layers/w_up": (num_dense, d, f),
                       "layers/w_down": (num_dense, f, d)})
    if cfg.moe is not None and num_dense < L:
        shapes.update({f"layers/{k}": (L - num_dense, *shape)
                       for k, shape in moe_shapes(cfg.moe, d).items()})
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
    if cfg.qkv_bias:
        shapes.update({"layers/bq": (L, cfg.q_size), "layers/bk": (L, cfg.kv_size),
                       "layers/bv": (L, cfg.kv_size)})
    if cfg.qk_norm:
        shapes.update({"layers/q_norm": (L, D), "layers/k_norm": (L, D)})
    return shapes


def jnp_dtype(cfg: ModelConfig) -> jnp.dtype:
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


class Llama(nnx.Module):
    """Parameter container. `params()` gives the nested dict the pure functions take."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp_dtype(cfg)
        weights: dict[str, dict[str, nnx.Param] | nnx.Param] = {}
        layers: dict[str, nnx.Param] = {}
        for name, shape in param_shapes(cfg).items():
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name.split("/")[-1].startswith("b") or name.endswith("bias"):
                value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
            else:
                fan_in = shape[-2] if len(shape) >= 2 and name != "embed" else 1
                scale = 0.02 if name == "embed" else 1.0 / math.sqrt(fan_in)
                value = scale * jax.random.normal(rngs.params(), shape, jnp.float32)
            param = nnx.Param(value.astype(dtype))
            if name.startswith("layers/"):
                layers[name.split("/", 1)[1]] = param
            else:
                weights[name] = param
        self.layers = nnx.Dict(layers)
        for name, param in weights.items():
            setattr(self, name, param)

    def params(self) -> Params:
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def set_params(self, params: Params) -> None:
        state = nnx.state(self, nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        nnx.update(self, state)


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    return Llama(cfg, rngs=nnx.Rngs(params=seed)).params()




def resolve_layer_weights(choice: str, platform: str) -> str:
    """`choice` (one of LAYER_WEIGHTS) for a mesh of `platform` ("cpu", "tpu", "gpu", ...)."""
    if choice not in LAYER_WEIGHTS:
        raise ConfigError(f"layer_weights={choice!r}; allowed: {', '.join(LAYER_WEIGHTS)}")
    if choice != "auto":
        return choice
    return "per_layer" if platform in ("gpu", "cuda", "rocm") else "stacked"


def layers_split(params: Params) -> bool:
    """Whether params hold their layers per layer (a tuple of dicts) rather than stacked."""
    return isinstance(params.get("layers"), tuple | list)


def kind_index(kinds: tuple[str, ...]) -> tuple[int, ...]:
    """Each layer's index among the layers of its kind."""
    return tuple(kinds[:i].count(kind) for i, kind in enumerate(kinds))


def split_layers(params: Params, cfg: ModelConfig | None = None) -> Params:
    """The same params with the layers as a tuple of per-layer dicts (arrays without the
    leading layers axis). A model mixing dense and MoE layers needs its `cfg`."""
    if layers_split(params):
        return params
    stacked = params["layers"]
    n = stacked["attn_norm"].shape[0]
    if cfg is None:
        if any(v.shape[0] != n for v in stacked.values()):
            raise ValueError("these params mix dense and MoE layers: split_layers needs the cfg")
        kinds = ("moe" if "router" in stacked else "dense",) * n
    else:
        kinds = cfg.layer_kinds
    index = kind_index(kinds)
    layers = tuple({k: v[i if key_kind(k) is None else index[i]] for k, v in stacked.items()
                    if key_kind(k) in (None, kinds[i])} for i in range(n))
    return {**params, "layers": layers}


def stack_layers(params: Params) -> Params:
    """The same params with the layers stacked on a leading axis (the inverse of split): each
    key stacked over the layers that hold it."""
    if not layers_split(params):
        return params
    layers = params["layers"]
    host = all(isinstance(v, np.ndarray) for lp in layers for v in lp.values())
    stack = np.stack if host else jnp.stack
    keys = dict.fromkeys(k for lp in layers for k in lp)
    return {**params, "layers": {k: stack([lp[k] for lp in layers if k in lp]) for k in keys}}


def layer_runs(kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Maximal runs of consecutive same-kind layers: [(kind, start, end)]."""
    runs: list[tuple[str, int, int]] = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], i + 1)
        else:
            runs.append((kind, i, i + 1))
    return runs


def flat_params(params: Params) -> dict[str, jax.Array]:
    """{"layers/wq": ..., "embed": ...} view of a params dict with stacked layers."""
    if layers_split(params):
        raise ValueError("flat_params takes stacked layers; these are per layer "
                         "(stack_layers gives the stacked form)")
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                out[f"{k}/{k2}"] = v2
        else:
            out[k] = v
    return out


def nest_params(flat: dict[str, Any]) -> Params:
    out: Params = {}
    for k, v in flat.items():
        if "/" in k:
            a, b = k.split("/", 1)
            out.setdefault(a, {})[b] = v
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------- math


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def rope_cos_sin(positions_n: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [N, head_dim] in the HF `rotate_half` convention."""
    freqs = positions_n.astype(jnp.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_nhd: jax.Array, cos_nd: jax.Array, sin_nd: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, per half (the tables' halves are equal): the same
    products and sums, with no rotated copy of x for XLA:TPU to write out (a float32 [N, H, D]
    a layer at a prefill chunk)."""
    x = x_nhd.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos_nd[:, None, :half], sin_nd[:, None, :half]
    y = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y.astype(x_nhd.dtype)


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens_n: jax.Array,
    positions_n: jax.Array,
    cache: Any,
    attn_meta: Any,
    attention: AttentionFn,
    logits_index: jax.Array | None = None,
    unroll: int | bool = 1,
    return_routing: bool = False,
    expert_mesh: Any = None,
    token_mask: jax.Array | None = None,
) -> tuple[jax.Array, Any] | tuple[jax.Array, Any, jax.Array]:
    """One forward pass over N flat tokens.

    `unroll`: the layer scan's unroll (True: no loop; compiled cost analyses count a loop body
    once, an unrolled stack per layer). Per-layer params always run unrolled.
    Returns (logits [N or len(logits_index), vocab] float32, updated cache), and with
    `return_routing` the expert ids every MoE layer chose for every token
    ([num_moe_layers, N, num_experts_per_tok] int32). `expert_mesh`: a mesh whose "tp" axis
    splits the experts (expert parallelism under `shard_map`, `seer_jax.model.moe`).
    `token_mask` [N] bool: False marks padding tokens, which reach no routed expert (their rows
    are the step's padding; nothing else reads them).
    """
    dtype = jnp_dtype(cfg)
    N = tokens_n.shape[0]
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = params["embed"][tokens_n].astype(dtype)
    if cfg.mla is not None:
        cos, sin = mla.rope_cos_sin(positions_n, cfg)
    else:
        cos, sin = rope_cos_sin(positions_n, cfg)

    def latent_attention(h, cache, lp, i, cos, sin, attn_meta):
        """MLA in its absorbed form: the backend stores the latent rows and attends in the
        latent space."""
        c_kv, k_rope = mla.project_latent(h, lp, cfg, cos, sin)
        q_nope, q_rope = mla.project_queries(h, lp, cfg, cos, sin)
        q_latent = mla.absorb_queries(q_nope, lp, cfg)
        o_latent, cache = attention(cache, attn_meta, i, q_latent, q_rope, c_kv, k_rope)
        return mla.unabsorb_output(o_latent.astype(dtype), lp, cfg) @ lp["wo"], cache

    def block(x, cache, lp, i, cos, sin, attn_meta, token_mask, kind):
        h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        if cfg.mla is not None:
            attn, cache = latent_attention(h, cache, lp, i, cos, sin, attn_meta)
            return mlp(x + attn, cache, lp, token_mask, kind)
        if N * 4 >= cfg.hidden_size:
            # projected straight into [N, heads, head_dim]: XLA:TPU then copies the weights
            # into that tiled layout once, where a matmul and a reshape copy the activations
            # into it (and again around the norms and rotary embedding), which costs more
            # from about a quarter of the hidden size in tokens (prefill chunks, not decode)
            q = jnp.einsum("nd,dhk->nhk", h, lp["wq"].reshape(-1, H, D))
            k = jnp.einsum("nd,dhk->nhk", h, lp["wk"].reshape(-1, K, D))
            v = jnp.einsum("nd,dhk->nhk", h, lp["wv"].reshape(-1, K, D))
            if cfg.qkv_bias:
                q = q + lp["bq"].reshape(H, D)
                k, v = k + lp["bk"].reshape(K, D), v + lp["bv"].reshape(K, D)
        else:
            q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
            if cfg.qkv_bias:
                q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
            q, k, v = q.reshape(N, H, D), k.reshape(N, K, D), v.reshape(N, K, D)
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn, cache = attention(cache, attn_meta, i, q, k, v)
        return mlp(x + attn.reshape(N, H * D).astype(dtype) @ lp["wo"], cache, lp, token_mask,
                   kind)

    def mlp(x, cache, lp, token_mask, kind):
        h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        if kind == "moe":
            out, ids = moe_mlp(h, lp, cfg.moe, expert_mesh, token_mask)
            return x + out, cache, ids
        x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
        return x, cache, None

    kinds = cfg.layer_kinds
    routing = []
    if layers_split(params):
        if len(params["layers"]) != cfg.num_layers:
            raise ValueError(f"{len(params['layers'])} per-layer weight dicts for a model of "
                             f"{cfg.num_layers} layers")
        # one jitted block called per layer: traced and lowered once per kind (its kernels
        # included), so compile time grows with depth only in the compiler, not in tracing and
        # lowering
        step = jax.jit(block, static_argnames="kind")
        for i, lp in enumerate(params["layers"]):
            x, cache, ids = step(x, cache, lp, jnp.int32(i), cos, sin, attn_meta, token_mask,
                                 kind=kinds[i])
            if ids is not None:
                routing.append(ids[None])
    else:
        index = kind_index(kinds)
        for kind, start, end in layer_runs(kinds):
            def layer(carry, inputs, kind=kind):
                x, cache, ids = block(*carry, *inputs, cos, sin, attn_meta, token_mask,
                                      kind=kind)
                return (x, cache), ids

            n = end - start
            xs = {}
            for k, v in params["layers"].items():
                lo = start if key_kind(k) is None else index[start]
                if key_kind(k) in (None, kind):
                    xs[k] = v if (lo, n) == (0, v.shape[0]) else jax.lax.slice_in_dim(v, lo, lo + n)
            (x, cache), ids = jax.lax.scan(layer, (x, cache), (xs, jnp.arange(start, end)),
                                           unroll=unroll)
            if ids is not None:
                routing.append(ids)
    if logits_index is not None:
        x = x[logits_index]
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = jnp.dot(x, head.astype(dtype), preferred_element_type=jnp.float32)
    if return_routing:
        k = cfg.moe.num_experts_per_tok if cfg.moe is not None else 0
        routed = (jnp.concatenate(routing) if routing else jnp.zeros((0, N, k), jnp.int32))
        return logits, cache, routed
    return logits, cache
