"""Device side of the engine: the paged KV cache and the jitted step.

One step runs the decoder over a flat batch of N tokens laid out in two ragged regions:
  decode region  [0, n_dec * q_dec)          sequences with q_len <= q_dec (decode; verify trees)
  prefill region [n_dec * q_dec, N)          up to n_pre sequences of chunked prefill
Each region is one `ragged_paged_attention` call per layer (on CPU the jnp reference, whose cost
scales with max_q_len, so splitting keeps decodes cheap next to a long prefill chunk). Which
attention runs, and how kernels run under `shard_map` on a tp mesh: `attention_backend`. All shapes
come from a small set of padded buckets (`Layout`), so steady state never recompiles.

KV cache: k_all, v_all [num_layers, num_kv_heads * kv_repeat, num_pages, page_size, head_dim],
carried through the layer scan and donated to every step, so updates happen in place.

A mesh may span several processes under `jax.distributed` (a slice over several hosts). Every
process of the slice then runs the same calls in the same order (SPMD); host inputs go to the
device replicated over the whole mesh (`device_input`), and results come back with `to_host`,
which reads a replicated result from a local shard and gathers a sharded one from every process.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seer_jax.engine.attention_backend import (
    AttentionPlan,
    check_kernel_shapes,
    kernel_attention,
    kernel_write,
    make_plan,
)
from seer_jax.engine.batch import Layout, StepBatch, uses_cpu_decode
from seer_jax.engine.cpu_attention import gather_pages, paged_decode_attention
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params, forward, jnp_dtype
from seer_jax.model.sampling import request_keys, sample_tokens, top_logprobs
from seer_jax.model.sampling_acceptance import accept_draft_tree
from seer_jax.model.sharding import ShardingRules, shard_params
from seer_jax.pallas import ragged_paged_attention

TRACE_COUNTS: dict[str, int] = {"step": 0}
# compiled steps by (function, static args, shapes, sharding), least recently used first; bounded
# so that engines kept alive for days (a trainer's) do not accumulate executables without end
_EXECUTABLES: collections.OrderedDict[tuple, object] = collections.OrderedDict()
MAX_EXECUTABLES = 512


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Host-clock seconds of the runner's last step, by phase: inputs to the device (h2d), the
    compiled step until its outputs are ready (device, dispatch included), outputs back to the
    host (d2h). Compiling a new shape is not in them (`ModelRunner.compile_s`)."""

    h2d_s: float = 0.0
    device_s: float = 0.0
    d2h_s: float = 0.0


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether the mesh holds devices of other processes (a multi-host slice)."""
    return mesh is not None and any(d.process_index != jax.process_index()
                                    for d in mesh.devices.flat)


def to_host(x: jax.Array) -> np.ndarray:
    """A device array's value on this host. On a mesh that spans processes a replicated array is
    read from a local shard, a sharded one is gathered from every process (a collective: every
    process of the slice calls it at the same point)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _paged_attention(cache, meta, layer, q, k, v, *, layout: Layout, plan: AttentionPlan):
    """One layer's KV write + attention over both regions. The cache is the whole
    [L, Hkv_cache, P, S, D] pool carried through the layer scan; nothing here slices a layer out
    of it (that would copy the layer's page pool on every layer of every step)."""
    k_all, v_all = cache
    _, _, num_pages, page_size, _ = k_all.shape
    slots = meta["slots"]
    if plan.kernel:
        k_all, v_all = kernel_write(plan, k_all, v_all, k, v, slots, layer)
    else:
        n_slots = num_pages * page_size
        s = jnp.where((slots >= 0) & (slots < n_slots), slots, n_slots)
        pg, off = s // page_size, s % page_size
        k_all = k_all.at[layer, :, pg, off].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[layer, :, pg, off].set(v.astype(v_all.dtype), mode="drop")
    outs = []
    split = layout.n_dec * layout.q_dec

    def attend(q_region, prefix, max_q_len, parents=None):
        kv_lens, table = meta[f"{prefix}_kv_lens"], meta[f"{prefix}_pages"]
        cu, num = meta[f"{prefix}_cu"], meta[f"{prefix}_num"]
        if plan.kernel:
            return kernel_attention(plan, q_region, k_all, v_all, kv_lens, table, cu, num,
                                    layer=layer, tree_parents=parents)
        if plan.impl == "reference":
            return ragged_paged_attention(q_region, k_all, v_all, kv_lens, table, cu, num,
                                          tree_parents=parents, max_q_len=max_q_len,
                                          impl="reference", layer=layer)
        # cpu: gather only the region's pages, then the reference on that small pool.
        flat = table.reshape(-1)
        local = jnp.arange(flat.shape[0], dtype=jnp.int32).reshape(table.shape)
        return ragged_paged_attention(
            q_region, gather_pages(k_all, flat, layer), gather_pages(v_all, flat, layer),
            kv_lens, local, cu, num, tree_parents=parents, max_q_len=max_q_len,
            impl="reference")

    if layout.n_dec and uses_cpu_decode(plan.impl, layout) and meta.get("dec_parents") is None:
        outs.append(paged_decode_attention(
            q[:split], k_all, v_all, meta["dec_kv_lens"], meta["dec_pages"], meta["dec_num"],
            layer=layer))
    elif layout.n_dec:
        outs.append(attend(q[:split], "dec", layout.q_dec, meta.get("dec_parents")))
    if layout.n_pre:
        outs.append(attend(q[split:], "pre", layout.t_pre))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return out, (k_all, v_all)


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "plan", "num_top", "unroll"),
                   donate_argnames=("k_all", "v_all"))
def _sample_step(params, k_all, v_all, batch, *, cfg, layout, plan, num_top, unroll=1):
    TRACE_COUNTS["step"] += 1
    attention = functools.partial(_paged_attention, layout=layout, plan=plan)
    logits, (k_all, v_all) = forward(params, cfg, batch["tokens"], batch["positions"],
                                     (k_all, v_all), batch, attention,
                                     logits_index=batch["logits_index"], unroll=unroll)
    keys = request_keys(batch["seeds"], batch["gen_index"])
    toks, lps = sample_tokens(logits, keys, batch["temperature"], batch["top_p"], batch["top_k"])
    top = None
    if num_top:
        top = top_logprobs(logits, batch["temperature"], batch["top_p"], batch["top_k"], num_top)
    return k_all, v_all, toks, lps, top


@functools.partial(jax.jit, static_argnames=("cfg", "layout", "plan", "unroll"),
                   donate_argnames=("k_all", "v_all"))
def _verify_step(params, k_all, v_all, batch, *, cfg, layout, plan, unroll=1):
    """Speculative step: the decode region holds [last token, draft nodes...] per sequence (a
    token tree via dec_parents); every decode-region token gets logits, and the draft tree is
    accepted or rejected losslessly. Prefill rows are sampled as usual."""
    TRACE_COUNTS["step"] += 1
    attention = functools.partial(_paged_attention, layout=layout, plan=plan)
    logits, (k_all, v_all) = forward(params, cfg, batch["tokens"], batch["positions"],
                                     (k_all, v_all), batch, attention,
                                     logits_index=batch["logits_index"], unroll=unroll)
    nd, q = layout.n_dec, layout.q_dec
    keys = request_keys(batch["seeds"], batch["gen_index"])
    temp, top_p, top_k = batch["temperature"], batch["top_p"], batch["top_k"]
    res = accept_draft_tree(batch["draft_tokens"], batch["draft_parents"], batch["num_draft"],
                            logits[: nd * q].reshape(nd, q, -1), temp[: nd * q: q],
                            top_p[: nd * q: q], top_k[: nd * q: q], keys[: nd * q: q])
    pre = None
    if layout.n_pre:
        pre = sample_tokens(logits[nd * q:], keys[nd * q:], temp[nd * q:], top_p[nd * q:],
                            top_k[nd * q:])
    return k_all, v_all, res, pre


@functools.partial(jax.jit, donate_argnames=("k_all", "v_all"))
def _move_slots(k_all, v_all, src, dst):
    L, H, P, S, D = k_all.shape
    kf, vf = k_all.reshape(L, H, P * S, D), v_all.reshape(L, H, P * S, D)
    kf = kf.at[:, :, dst].set(kf[:, :, src])
    vf = vf.at[:, :, dst].set(vf[:, :, src])
    return kf.reshape(L, H, P, S, D), vf.reshape(L, H, P, S, D)


@functools.partial(jax.jit, donate_argnames=("k_all", "v_all"))
def _copy_pages(k_all, v_all, src, dst):
    return k_all.at[:, :, dst].set(k_all[:, :, src]), v_all.at[:, :, dst].set(v_all[:, :, src])


@functools.partial(jax.jit, donate_argnames=("k_all", "v_all"))
def _write_pages(k_all, v_all, pages, k_new, v_new):
    return k_all.at[:, :, pages].set(k_new), v_all.at[:, :, pages].set(v_new)


@jax.jit
def _read_pages(k_all, v_all, pages):
    return k_all[:, :, pages], v_all[:, :, pages]


def cache_shape(cfg: ModelConfig, plan: AttentionPlan, num_pages: int,
                page_size: int) -> tuple[int, ...]:
    """Shape of each of the K and V caches: [L, Hkv * kv_repeat, P, S, D]."""
    return (cfg.num_layers, cfg.num_kv_heads * plan.kv_repeat, num_pages, page_size,
            cfg.head_dim)


def cache_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """The caches' sharding on a mesh: KV heads over tp where they divide, else replicated."""
    tp = mesh.shape.get("tp", 1)
    return NamedSharding(mesh, PartitionSpec(None, "tp" if shape[1] % tp == 0 else None))


def step_function(kind: str):
    """The jitted step: "sample" (decode and prefill rows sampled) or "verify" (the decode
    region verifies draft trees)."""
    return {"sample": _sample_step, "verify": _verify_step}[kind]


class ModelRunner:
    """Owns params and the paged KV cache of one engine, on one mesh slice."""

    def __init__(self, cfg: ModelConfig, params: Params, num_pages: int, page_size: int,
                 mesh: Mesh | None = None, attention_impl: str = "auto",
                 rules: ShardingRules = ShardingRules(), *, max_seqs: int = 0,
                 pages_per_seq: int = 0, max_tokens: int = 0):
        """max_seqs, pages_per_seq, max_tokens: the largest batch the engine will build; with
        them a kernel impl that cannot lower for these shapes is refused here (ConfigError)."""
        self.cfg = cfg
        self.page_size = page_size
        self.num_pages = num_pages
        self.mesh = mesh
        # host inputs of a slice spanning processes: replicated over the whole mesh
        self._replicated = NamedSharding(mesh, PartitionSpec()) if spans_processes(mesh) else None
        self.plan = make_plan(cfg, attention_impl, mesh)
        self.impl = self.plan.impl  # resolved: reference | cpu | tpu | gpu
        dtype = jnp_dtype(cfg)
        if max_seqs:
            check_kernel_shapes(self.plan, cfg, page_size=page_size,
                                dtype_bytes=jnp.dtype(dtype).itemsize, max_seqs=max_seqs,
                                pages_per_seq=pages_per_seq, max_tokens=max_tokens)
        self.compile_s = 0.0  # time spent compiling new step shapes
        self.timings = StepTimings()  # phases of the last sample/verify step
        self.rules = rules
        self.set_params(params)
        self.kv_repeat = self.plan.kv_repeat
        shape = cache_shape(cfg, self.plan, num_pages, page_size)
        if mesh is not None:
            sharding = cache_sharding(mesh, shape)
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
            self.k_all, self.v_all = zeros(), zeros()
        else:
            self.k_all, self.v_all = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def device_input(self, x, dtype=None) -> jax.Array:
        """A host array as a step input: on this process's default device, or replicated over a
        mesh that spans processes (every process passes the same value)."""
        if self._replicated is None:
            return jnp.asarray(x, dtype)
        return jax.device_put(np.asarray(x, dtype), self._replicated)

    def set_params(self, params: Params) -> None:
        if self._replicated is not None:
            # this process's arrays go to the mesh through the host: each process places its
            # own shards of the same values
            params = jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable
                else x, params)
        self.params = shard_params(params, self.mesh, self.rules) if self.mesh is not None else params

    def _executable(self, fn, dev: dict, **static):
        """The compiled step for these shapes: compiled ahead of time on first use (its time
        goes to `compile_s`, not to the step), shared by every runner with the same shapes and
        shardings."""
        key = (fn.__name__, tuple(sorted(static.items())), tuple(sorted((k, v.shape) for k, v in dev.items())),
               self.k_all.shape, str(self.k_all.dtype), str(self.k_all.sharding),
               tuple(sorted(d.id for d in self.k_all.sharding.device_set)))
        exe = _EXECUTABLES.get(key)
        if exe is not None:
            _EXECUTABLES.move_to_end(key)
        else:
            t0 = time.perf_counter()
            exe = fn.lower(self.params, self.k_all, self.v_all, dev, **static).compile()
            self.compile_s += time.perf_counter() - t0
            _EXECUTABLES[key] = exe
            while len(_EXECUTABLES) > MAX_EXECUTABLES:
                _EXECUTABLES.popitem(last=False)
        return exe

    def sample(self, batch: StepBatch, num_top: int = 0):
        """Run a step and sample one token per row; host arrays (tokens [rows], logprobs
        [rows], top-logprobs or None)."""
        layout = batch.layout
        t0 = time.perf_counter()
        dev = jax.block_until_ready({k: self.device_input(v) for k, v in batch.arrays().items()})
        t1 = time.perf_counter()
        exe = self._executable(_sample_step, dev, cfg=self.cfg, layout=layout, plan=self.plan,
                               num_top=num_top)
        t2 = time.perf_counter()
        self.k_all, self.v_all, toks, lps, top = jax.block_until_ready(
            exe(self.params, self.k_all, self.v_all, dev))
        t3 = time.perf_counter()
        toks, lps = to_host(toks), to_host(lps)
        if top is not None:
            top = (to_host(top[0]), to_host(top[1]))
        self.timings = StepTimings(t1 - t0, t3 - t2, time.perf_counter() - t3)
        return toks, lps, top

    def verify(self, batch: StepBatch):
        """Run a speculative step; returns host arrays (tokens [n_dec, q], logprobs [n_dec, q],
        num_accepted [n_dec], accepted_nodes [n_dec, q-1]) and the prefill (tokens, logprobs)."""
        layout = batch.layout
        t0 = time.perf_counter()
        dev = jax.block_until_ready({k: self.device_input(v) for k, v in batch.arrays().items()})
        t1 = time.perf_counter()
        exe = self._executable(_verify_step, dev, cfg=self.cfg, layout=layout, plan=self.plan)
        t2 = time.perf_counter()
        self.k_all, self.v_all, res, pre = jax.block_until_ready(
            exe(self.params, self.k_all, self.v_all, dev))
        t3 = time.perf_counter()
        out = (to_host(res.tokens), to_host(res.logprobs), to_host(res.num_accepted),
               to_host(res.accepted_nodes))
        pre = None if pre is None else (to_host(pre[0]), to_host(pre[1]))
        self.timings = StepTimings(t1 - t0, t3 - t2, time.perf_counter() - t3)
        return out, pre

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V at cache slots src to slots dst (all layers): compacts an accepted tree
        path into consecutive positions."""
        if src:
            self.k_all, self.v_all = _move_slots(self.k_all, self.v_all,
                                                 self.device_input(src, jnp.int32),
                                                 self.device_input(dst, jnp.int32))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = self.device_input([p[0] for p in pairs], jnp.int32)
        dst = self.device_input([p[1] for p in pairs], jnp.int32)
        self.k_all, self.v_all = _copy_pages(self.k_all, self.v_all, src, dst)

    def read_kv(self, pages: list[int], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies [num_layers, num_kv_heads, num_tokens, head_dim] of a page table's tokens."""
        k, v = _read_pages(self.k_all, self.v_all, self.device_input(pages, jnp.int32))
        L, H, P, S, D = k.shape
        k = to_host(k).reshape(L, H, P * S, D)[:, :: self.kv_repeat, :num_tokens]
        v = to_host(v).reshape(L, H, P * S, D)[:, :: self.kv_repeat, :num_tokens]
        return k, v

    def write_kv(self, pages: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of `read_kv` (k, v: [num_layers, num_kv_heads, n, head_dim])."""
        if self.kv_repeat > 1:
            k, v = np.repeat(k, self.kv_repeat, axis=1), np.repeat(v, self.kv_repeat, axis=1)
        L, H, n, D = k.shape
        S = self.page_size
        pad = len(pages) * S - n
        k = np.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(L, H, len(pages), S, D)
        v = np.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(L, H, len(pages), S, D)
        dtype = self.k_all.dtype
        self.k_all, self.v_all = _write_pages(self.k_all, self.v_all,
                                              self.device_input(pages, jnp.int32),
                                              self.device_input(k, dtype), self.device_input(v, dtype))
