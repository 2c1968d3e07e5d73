"""The engine step's pure functions: the decoder over a step's two ragged regions with the
attention each region needs (the CPU decode path, the reference, or the Pallas kernels under
`attention_backend`; latent attention under `mla_backend`), sampling or draft verification,
the packing of a step's outputs into one vector, the small cache operations the runner jits
(slot moves, page copies, imports, page-table entries) and the cache's shape, sharding and
pinned device format. `model_runner.ModelRunner` compiles and runs them."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format
from jax.experimental.layout import Layout as DeviceLayout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seer_jax.engine.attention_backend import (
    AttentionPlan,
    kernel_attention,
    kernel_write,
)
from seer_jax.engine.batch import Layout, uses_cpu_decode
from seer_jax.engine.cpu_attention import gather_pages, paged_decode_attention
from seer_jax.engine.mla_backend import (
    paged_mla_attention,
)
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import (
    forward,
)
from seer_jax.model.mla import softmax_scale
from seer_jax.model.sampling import request_keys, sample_tokens, top_logprobs
from seer_jax.model.sampling_acceptance import accept_draft_tree
from seer_jax.pallas import ragged_paged_attention, write_kv_reference
from seer_jax.pallas.kv_layout import kv_cache_shape
from seer_jax.pallas.mla_layout import latent_cache_shape

# how many times a step function was traced (tests and benchmarks check that steady state
# never retraces)
TRACE_COUNTS: dict[str, int] = {"step": 0}


def _paged_attention(cache, meta, layer, q, k, v, *, layout: Layout, plan: AttentionPlan):
    """One layer's KV write + attention over both regions. The cache is the whole
    [L, P, S, 2 * Hkv_cache, D] pool carried through the layer scan; nothing here slices a layer
    out of it (that would copy the layer's page pool on every layer of every step)."""
    kv_all = cache
    _, num_pages, page_size, _, _ = kv_all.shape
    slots = meta["slots"]
    if plan.wrapped:
        kv_all = kernel_write(plan, kv_all, k, v, slots, layer)
    else:
        kv_all = write_kv_reference(kv_all, k, v, slots, layer)
    outs = []
    split = layout.n_dec * layout.q_dec

    def region_table(prefix):
        """The region's page tables: rows of the persistent device table, or its own."""
        if f"{prefix}_rows" in meta:
            return meta["page_table"][meta[f"{prefix}_rows"], :layout.pps]
        return meta[f"{prefix}_pages"]

    def attend(q_region, prefix, max_q_len, parents=None):
        kv_lens, table = meta[f"{prefix}_kv_lens"], region_table(prefix)
        cu, num = meta[f"{prefix}_cu"], meta[f"{prefix}_num"]
        if plan.wrapped:
            return kernel_attention(plan, q_region, kv_all, kv_lens, table, cu, num,
                                    layer=layer, tree_parents=parents, max_q_len=max_q_len)
        if plan.impl == "reference":
            return ragged_paged_attention(q_region, kv_all, kv_lens, table, cu, num,
                                          tree_parents=parents, max_q_len=max_q_len,
                                          impl="reference", layer=layer)
        # cpu: gather only the region's pages, then the reference on that small pool.
        flat = table.reshape(-1)
        local = jnp.arange(flat.shape[0], dtype=jnp.int32).reshape(table.shape)
        return ragged_paged_attention(
            q_region, gather_pages(kv_all, flat, layer), kv_lens, local, cu, num,
            tree_parents=parents, max_q_len=max_q_len, impl="reference")

    if layout.n_dec and uses_cpu_decode(plan.impl, layout) and meta.get("dec_parents") is None:
        if "dec_rows" in meta:  # rows of the persistent table, read in place
            outs.append(paged_decode_attention(
                q[:split], kv_all, meta["dec_kv_lens"], meta["page_table"], meta["dec_num"],
                layer=layer, rows=meta["dec_rows"]))
        else:
            outs.append(paged_decode_attention(
                q[:split], kv_all, meta["dec_kv_lens"], meta["dec_pages"], meta["dec_num"],
                layer=layer))
    elif layout.n_dec:
        outs.append(attend(q[:split], "dec", layout.q_dec, meta.get("dec_parents")))
    if layout.n_pre:
        outs.append(attend(q[split:], "pre", layout.t_pre))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out, kv_all


def _step_attention(cfg: ModelConfig, layout: Layout, plan: AttentionPlan):
    """The step's attention backend: K/V pages, or latent rows for MLA."""
    if cfg.mla is not None:
        return functools.partial(paged_mla_attention, layout=layout, plan=plan,
                                 sm_scale=softmax_scale(cfg))
    return functools.partial(_paged_attention, layout=layout, plan=plan)


def _sample_step(params, kv_all, batch, *, cfg, layout, plan, num_top, unroll=1, routed=False):
    """routed: the MoE routers' expert ids of every sampled row follow the outputs
    ([rows, num_moe_layers, experts per token])."""
    TRACE_COUNTS["step"] += 1
    attention = _step_attention(cfg, layout, plan)
    logits, kv_all, *routing = forward(
        params, cfg, batch["tokens"], batch["positions"], kv_all, batch, attention,
        logits_index=batch["logits_index"], unroll=unroll, expert_mesh=plan.expert_mesh,
        return_routing=routed, token_mask=batch["slots"] >= 0)
    keys = request_keys(batch["seeds"], batch["gen_index"])
    toks, lps = sample_tokens(logits, keys, batch["temperature"], batch["top_p"], batch["top_k"])
    out = [toks, lps]
    if num_top:
        out += top_logprobs(logits, batch["temperature"], batch["top_p"], batch["top_k"], num_top)
    if routed:
        out.append(routing[0][:, batch["logits_index"]].transpose(1, 0, 2))
    return kv_all, pack_outputs(*out)


def _verify_step(params, kv_all, batch, *, cfg, layout, plan, unroll=1, routed=False):
    """Speculative step: the decode region holds [last token, draft nodes...] per sequence (a
    token tree via dec_parents); every decode-region token gets logits, and the draft tree is
    accepted or rejected losslessly. Prefill rows are sampled as usual. routed: the routers'
    expert ids of every row (each decode-region token, each prefill row) follow the outputs."""
    TRACE_COUNTS["step"] += 1
    attention = _step_attention(cfg, layout, plan)
    logits, kv_all, *routing = forward(
        params, cfg, batch["tokens"], batch["positions"], kv_all, batch, attention,
        logits_index=batch["logits_index"], unroll=unroll, expert_mesh=plan.expert_mesh,
        return_routing=routed, token_mask=batch["slots"] >= 0)
    nd, q = layout.n_dec, layout.q_dec
    keys = request_keys(batch["seeds"], batch["gen_index"])
    temp, top_p, top_k = batch["temperature"], batch["top_p"], batch["top_k"]
    res = accept_draft_tree(batch["draft_tokens"], batch["draft_parents"], batch["num_draft"],
                            logits[: nd * q].reshape(nd, q, -1), temp[: nd * q: q],
                            top_p[: nd * q: q], top_k[: nd * q: q], keys[: nd * q: q])
    out = [res.tokens, res.logprobs, res.num_accepted, res.accepted_nodes]
    if layout.n_pre:
        out += sample_tokens(logits[nd * q:], keys[nd * q:], temp[nd * q:], top_p[nd * q:],
                             top_k[nd * q:])
    if routed:
        out.append(routing[0][:, batch["logits_index"]].transpose(1, 0, 2))
    return kv_all, pack_outputs(*out)


def pack_outputs(*arrays: jax.Array) -> jax.Array:
    """The step's results as one int32 vector (float32 bit-cast), so that they come back to the
    host in a single transfer; `sample_outputs` / `verify_outputs` take it apart. Sampled tokens
    come first: a later step reads its pending tokens from positions [0, rows) on the device."""
    parts = [(a if a.dtype == jnp.int32 else
              jax.lax.bitcast_convert_type(a, jnp.int32) if a.dtype == jnp.float32
              else a.astype(jnp.int32)).reshape(-1) for a in arrays]
    return jnp.concatenate(parts)


def _unpack(packed: np.ndarray, shapes) -> list[np.ndarray]:
    out, at = [], 0
    for shape, dtype in shapes:
        n = int(np.prod(shape))
        part = packed[at:at + n].reshape(shape)
        out.append(part.view(np.float32) if dtype == "f" else part)
        at += n
    if at != packed.size:
        raise ValueError(f"packed step outputs hold {packed.size} values, expected {at}")
    return out


def sample_outputs(packed: np.ndarray, layout: Layout, num_top: int):
    """(tokens [rows], logprobs [rows], (top ids, top logprobs) [rows, num_top] or None)."""
    R = layout.num_rows
    shapes = [((R,), "i"), ((R,), "f")] + ([((R, num_top), "i"), ((R, num_top), "f")] if num_top else [])
    toks, lps, *top = _unpack(packed, shapes)
    return toks, lps, (tuple(top) if top else None)


def verify_outputs(packed: np.ndarray, layout: Layout):
    """((tokens [n_dec, q], logprobs [n_dec, q], num_accepted [n_dec], accepted_nodes
    [n_dec, q-1]), (prefill tokens, logprobs) [n_pre] or None)."""
    nd, q, npre = layout.n_dec, layout.q_dec, layout.n_pre
    shapes = [((nd, q), "i"), ((nd, q), "f"), ((nd,), "i"), ((nd, q - 1), "i")]
    if npre:
        shapes += [((npre,), "i"), ((npre,), "f")]
    toks, lps, n_acc, nodes, *pre = _unpack(packed, shapes)
    return (toks, lps, n_acc, nodes), (tuple(pre) if pre else None)


def _unpack_inputs(flat, spec):
    """The step's input arrays from one int32 vector: spec is ((name, shape, dtype str), ...)
    in packing order; 32-bit floats and unsigned ints are bit-cast back."""
    out, at = {}, 0
    for name, shape, dtype in spec:
        n = math.prod(shape)
        part = flat[at:at + n].reshape(shape)
        out[name] = part if dtype == "<i4" else jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
        at += n
    return out


def _merge_tokens(tokens, src, prev):
    """The step's input tokens with those still on the device filled in: token i is
    prev[src[i]] (a sampled token of the previous step's packed outputs) where src[i] >= 0."""
    return jnp.where(src >= 0, prev[jnp.clip(src, 0, prev.shape[0] - 1)], tokens)


STEP_STATIC = {_sample_step: ("cfg", "layout", "plan", "num_top"),
               _verify_step: ("cfg", "layout", "plan")}
# optional static arguments: `unroll`, the layer scan's unroll (compiled cost analyses count a
# loop body once); `routed`, the routed expert ids of every row
STEP_OPTIONAL = ("unroll", "routed")


def cache_format(sharding, ndim: int = 5) -> Format:
    """The cache's pinned device format: row-major [L, P, S, C, D] (or the latent [L, P, S, W])
    with `sharding`."""
    return Format(DeviceLayout(major_to_minor=tuple(range(ndim))), sharding)


def step_jit(fn, kv_format: Format, params, replicated, **static):
    """`fn` (`_sample_step` / `_verify_step`) with its static arguments bound, jitted with the
    cache donated and its format pinned on the way in and out; params keep their shardings,
    batch inputs and the packed outputs are `replicated`. Call it as f(params, kv_all, batch);
    it returns (kv_all, packed outputs)."""
    if not set(STEP_STATIC[fn]) <= set(static) <= set(STEP_STATIC[fn] + STEP_OPTIONAL):
        raise TypeError(f"{fn.__name__} takes static {STEP_STATIC[fn]} (optional "
                        f"{STEP_OPTIONAL}), got {tuple(static)}")
    param_sh = jax.tree.map(lambda x: x.sharding, params)
    gpu = next(iter(replicated.device_set)).platform in ("gpu", "cuda", "rocm")
    return jax.jit(functools.partial(fn, **static), donate_argnums=(1,),
                   in_shardings=(param_sh, kv_format, replicated),
                   out_shardings=(kv_format, replicated),
                   compiler_options=GPU_COMPILER_OPTIONS if gpu else None)


# XLA:GPU's dot merger joins GEMMs that share an input into one over their weights
# concatenated: a MoE layer's routed gate projection with its shared experts' (DeepSeek-V3)
# becomes a copy of the layer's local gate experts into the merged layout every step (at
# Moonlight-16B-A3B's H100 tp2 decode step, 10 GB of 49 read). Off for the engine's steps.
GPU_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def _move_slots(kv_all, src, dst):
    """dst past the end: padding, dropped."""
    L, P, S, *row = kv_all.shape
    flat = kv_all.reshape(L, P * S, *row)
    return flat.at[:, dst].set(flat[:, src], mode="drop").reshape(kv_all.shape)


def _copy_pages(kv_all, src, dst):
    return kv_all.at[:, dst].set(kv_all[:, src])


def _write_pages(kv_all, pages, kv_new):
    return kv_all.at[:, pages].set(kv_new)


def _read_pages(kv_all, pages):
    return kv_all[:, pages]


def _set_entries(table, idx, values):
    """table [R, W] with table.reshape(-1)[idx] = values (idx past the end: padding, dropped)."""
    return table.reshape(-1).at[idx].set(values, mode="drop").reshape(table.shape)


def cache_shape(cfg: ModelConfig, plan: AttentionPlan, num_pages: int,
                page_size: int) -> tuple[int, ...]:
    """Shape of the KV cache: [L, P, S, 2 * Hkv * kv_repeat, D] (MLA: [L, P, S, latent + rope])."""
    if cfg.mla is not None:
        return latent_cache_shape(cfg.num_layers, num_pages, page_size, cfg.mla.kv_lora_rank,
                                  cfg.mla.qk_rope_head_dim)
    return kv_cache_shape(cfg.num_layers, num_pages, page_size,
                          cfg.num_kv_heads * plan.kv_repeat, cfg.head_dim)


def cache_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """The cache's sharding on a mesh: KV heads (the interleaved K/V axis, whole heads per
    shard) over tp where they divide, else replicated (the MLA latent cache always)."""
    tp = mesh.shape.get("tp", 1)
    if len(shape) == 4:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(None, None, None,
                                             "tp" if shape[3] // 2 % tp == 0 else None))


def step_function(kind: str):
    """The step function: "sample" (decode and prefill rows sampled) or "verify" (the decode
    region verifies draft trees); jit it with `step_jit`."""
    return {"sample": _sample_step, "verify": _verify_step}[kind]


