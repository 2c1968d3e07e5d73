"""Device side of the engine: the paged KV cache and the jitted step (its pure functions are
in `step_fns`; this module compiles, dispatches and fetches them and owns the cache).

One step runs the decoder over a flat batch of N tokens laid out in two ragged regions:
  decode region  [0, n_dec * q_dec)          sequences with q_len <= q_dec (decode; verify trees)
  prefill region [n_dec * q_dec, N)          up to n_pre sequences of chunked prefill
Each region is one `ragged_paged_attention` call per layer (on CPU the jnp reference, whose cost
scales with max_q_len, so splitting keeps decodes cheap next to a long prefill chunk). Which
attention runs, and how kernels run under `shard_map` on a tp mesh: `attention_backend`. All shapes
come from a small set of padded buckets (`Layout`), so steady state never recompiles.

KV cache: kv_all [num_layers, num_pages, page_size, 2 * num_kv_heads * kv_repeat, head_dim], K and
V interleaved per KV head (`seer_jax.pallas.kv_layout`), carried through the layer scan and donated
to every step, so updates happen in place. Its device layout is pinned row-major (an explicit
`Format` on the allocation and on every jit that takes or returns it): left to choose, XLA on TPU
may give the cache a layout the kernels cannot read (e.g. page axis innermost) and then copy the
whole cache in and out of every step. A model with multi-head latent attention (`cfg.mla`) has
the latent cache [num_layers, num_pages, page_size, kv_lora_rank + qk_rope_head_dim] instead
(`seer_jax.pallas.mla_layout`, attended by `mla_backend`), replicated over tp.

A mesh may span several processes under `jax.distributed` (a slice over several hosts). Every
process of the slice then runs the same calls in the same order (SPMD); host inputs go to the
device replicated over the whole mesh (`device_input`), and results come back with `to_host`,
which reads a replicated result from a local shard and gathers a sharded one from every process.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from seer_jax.engine.attention_backend import (
    check_kernel_shapes,
    make_plan,
    mesh_platform,
)
from seer_jax.engine.batch import Layout, StepBatch, bucket
from seer_jax.engine.mla_backend import (
    check_mla_kernel_shapes,
    latent_rows_to_host,
    latent_rows_to_pages,
)
from seer_jax.engine.scatter_check import check_unique
from seer_jax.engine.step_fns import (  # noqa: F401 (several are re-exported)
    STEP_OPTIONAL,
    STEP_STATIC,
    TRACE_COUNTS,
    _copy_pages,
    _merge_tokens,
    _move_slots,
    _read_pages,
    _sample_step,
    _set_entries,
    _unpack_inputs,
    _verify_step,
    _write_pages,
    cache_format,
    cache_shape,
    cache_sharding,
    pack_outputs,
    sample_outputs,
    step_function,
    step_jit,
    verify_outputs,
)
from seer_jax.engine.xla_guard import STEP_LOCK, install_cpu_compile_guard
from seer_jax.model import moe
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import (
    Params,
    jnp_dtype,
    resolve_layer_weights,
    split_layers,
    stack_layers,
)
from seer_jax.model.sharding import ShardingRules, shard_params
from seer_jax.pallas.kv_layout import interleave_kv, split_kv

# compiled steps by (function, static args, shapes, sharding), least recently used first; bounded
# so that engines kept alive for days (a trainer's) do not accumulate executables without end
_EXECUTABLES: collections.OrderedDict[tuple, object] = collections.OrderedDict()
MAX_EXECUTABLES = 512
# outputs of steps dispatched and maybe still running (any runner of this process): compiling
# a new step waits for them first, so that XLA never compiles while a step executes in the
# background (overlap leaves one step in flight per engine; compiles are rare)
_IN_FLIGHT: collections.deque = collections.deque(maxlen=1024)
# held while a step is looked up, compiled and dispatched, and around all other device work of
# a runner: engines stepped on threads (`ConcurrentDriver`) share the executable cache and the
# fence above, so no step is dispatched while another thread compiles, and a shape is compiled
# once (`xla_guard`)
_STEP_LOCK = STEP_LOCK


@dataclasses.dataclass(frozen=True)
class StepTimings:
    """Host-clock seconds of the runner's last step, by phase: the host's part of sending the
    inputs (h2d: packing, transfers dispatched; what the device still spends receiving and
    unpacking them counts in device), the
    compiled step until its outputs are ready (device, dispatch included), outputs back to the
    host (d2h). Compiling a new shape is not in them (`ModelRunner.compile_s`). wait: the part
    of device the host spent blocked on the outputs (with overlap, zero when the step was done
    before the host came for it)."""

    h2d_s: float = 0.0
    device_s: float = 0.0
    d2h_s: float = 0.0
    wait_s: float = 0.0


@dataclasses.dataclass
class Launched:
    """A step dispatched to the device (`ModelRunner.launch`): its packed outputs, still on the
    device, and what is needed to read them (`ModelRunner.fetch`)."""

    kind: str  # "sample" | "verify"
    layout: Layout
    num_top: int
    packed: jax.Array
    h2d_s: float = 0.0
    dispatch_s: float = 0.0
    routed: tuple[int, ...] | None = None  # shape of the routed expert ids after the outputs


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


def _padded(x, n: int, fill: int) -> np.ndarray:
    """A new int32 [n] array: x, then `fill` (np.pad's result, without its Python overhead)."""
    out = np.full(n, fill, np.int32)
    out[:len(x)] = x
    return out


class ModelRunner:
    """Owns params and the paged KV cache of one engine, on one mesh slice."""

    def __init__(self, cfg: ModelConfig, params: Params, num_pages: int, page_size: int,
                 mesh: Mesh | None = None, attention_impl: str = "auto",
                 rules: ShardingRules = ShardingRules(), *, max_seqs: int = 0,
                 pages_per_seq: int = 0, max_tokens: int = 0, layer_weights: str = "auto",
                 routed_experts: bool = False):
        """max_seqs, pages_per_seq, max_tokens: the largest batch the engine will build; with
        them a kernel impl that cannot lower for these shapes is refused here (ConfigError).
        layer_weights: how the layer weights are held (`llama.LAYER_WEIGHTS`).
        routed_experts: steps also return the MoE routers' expert ids of every row (sampled
        rows; a verify step's every decode-region token) (`routed_experts` after each `fetch`)."""
        install_cpu_compile_guard()
        self.cfg = cfg
        self.routed = ((cfg.num_moe_layers, cfg.moe.num_experts_per_tok)
                       if routed_experts and cfg.moe is not None else None)
        self.routed_experts: np.ndarray | None = None  # [rows, moe layers, k] of the last fetch
        self.page_size = page_size
        self.num_pages = num_pages
        self.mesh = mesh
        # host inputs of a slice spanning processes: replicated over the whole mesh
        self._replicated = NamedSharding(mesh, PartitionSpec()) if spans_processes(mesh) else None
        self.plan = make_plan(cfg, attention_impl, mesh)
        self.impl = self.plan.impl  # resolved: reference | cpu | tpu | gpu
        dtype = jnp_dtype(cfg)
        if max_seqs and cfg.mla is not None:
            check_mla_kernel_shapes(self.plan, num_heads=cfg.num_heads,
                                    kv_lora_rank=cfg.mla.kv_lora_rank,
                                    rope_dim=cfg.mla.qk_rope_head_dim, page_size=page_size,
                                    dtype_bytes=jnp.dtype(dtype).itemsize, max_seqs=max_seqs,
                                    pages_per_seq=pages_per_seq, max_tokens=max_tokens)
        elif max_seqs:
            check_kernel_shapes(self.plan, cfg, page_size=page_size,
                                dtype_bytes=jnp.dtype(dtype).itemsize, max_seqs=max_seqs,
                                pages_per_seq=pages_per_seq, max_tokens=max_tokens)
        self._held_key = None  # (kv type, params, their part of an executable's key)
        self.compile_s = 0.0  # time spent compiling new step shapes
        # CPU time the calling thread spent blocked on steps' outputs (`fetch`): waiting for the
        # device, not host work, though the thread's CPU clock counts it
        self.wait_cpu_s = 0.0
        self.timings = StepTimings()  # phases of the last sample/verify step
        self.rules = rules
        self.layer_weights = resolve_layer_weights(layer_weights, mesh_platform(mesh))
        self.set_params(params)
        self.kv_repeat = self.plan.kv_repeat
        shape = cache_shape(cfg, self.plan, num_pages, page_size)
        if mesh is not None:
            sharding = cache_sharding(mesh, shape)
        else:
            sharding = SingleDeviceSharding(jax.devices()[0])
        self.kv_format = cache_format(sharding, len(shape))
        self._batch_sharding = (NamedSharding(mesh, PartitionSpec()) if mesh is not None
                                else sharding)
        fmt, rep = self.kv_format, self._batch_sharding
        with _STEP_LOCK:
            self.kv_all = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=fmt)()
        # cache maintenance, all in place (donated) and format-pinned like the steps
        self._move_slots = jax.jit(_move_slots, donate_argnums=0, in_shardings=(fmt, rep, rep),
                                   out_shardings=fmt)
        self._copy_pages = jax.jit(_copy_pages, donate_argnums=0, in_shardings=(fmt, rep, rep),
                                   out_shardings=fmt)
        self._write_pages = jax.jit(_write_pages, donate_argnums=0, in_shardings=(fmt, rep, rep),
                                    out_shardings=fmt)
        self._read_pages = jax.jit(_read_pages, in_shardings=(fmt, rep), out_shardings=rep)
        # the persistent page table ([rows, pages per seq] int32, a device copy of
        # `RequestRows.pages`) that decode steps on the CPU path index by row
        self.page_table: jax.Array | None = None
        self._set_entries = jax.jit(_set_entries, donate_argnums=0, in_shardings=(rep, rep, rep),
                                    out_shardings=rep)
        self._merge_tokens = jax.jit(_merge_tokens, in_shardings=(rep, rep, rep), out_shardings=rep)
        self._unpack_inputs = jax.jit(_unpack_inputs, static_argnums=1, in_shardings=(rep,),
                                      out_shardings=rep)

    def device_input(self, x, dtype=None) -> jax.Array:
        """A host array as a step input: on this process's default device, or replicated over a
        mesh that spans processes (every process passes the same value)."""
        x = np.asarray(x, dtype)
        if self._replicated is None:
            # (a transfer, no compiled conversion: jnp.asarray compiles one per new shape). A
            # copy: on the CPU a transfer may alias the host array, which the host reuses while
            # the step runs
            return jax.device_put(x.copy()) if x.dtype.itemsize <= 4 else jnp.asarray(x)
        return jax.device_put(x, self._replicated)

    def step_arg(self, x: np.ndarray):
        """A new host array that the host never writes again (packed step inputs, padded index
        lists) as an argument of a compiled call: passed as it is, and the call transfers it
        (cheaper than `device_input`; on the CPU the transfer may alias it, harmless for an
        array no one writes), or replicated over a mesh that spans processes."""
        return x if self._replicated is None else jax.device_put(x, self._replicated)

    def set_params(self, params: Params) -> None:
        """New weights (stacked or per layer), held as `layer_weights` says."""
        params = (split_layers(params, self.cfg) if self.layer_weights == "per_layer"
                  else stack_layers(params))
        if self._replicated is not None:
            # this process's arrays go to the mesh through the host: each process places its
            # own shards of the same values
            params = jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable
                else x, params)
        with _STEP_LOCK:
            self.params = (shard_params(params, self.mesh, self.rules) if self.mesh is not None
                           else params)

    def stacked_params(self) -> Params:
        """The weights with the layers stacked (how the model and trainers hold them)."""
        return stack_layers(self.params)

    def _executable(self, fn, dev: dict, **static):
        """The compiled step for these shapes: compiled ahead of time on first use (its time
        goes to `compile_s`, not to the step), shared by every runner with the same shapes and
        shardings and the same params structure (stacked or per-layer weights)."""
        kv, params = self.kv_all, self.params
        held, kv_type = self._held_key, (kv.shape, kv.dtype, kv.sharding)
        if held is None or held[1] is not params or held[0] != kv_type:
            # (what the cache and params contribute, recomputed only when they change)
            held = self._held_key = (kv_type, params, (
                kv.shape, str(kv.dtype), str(kv.sharding),
                tuple(sorted(d.id for d in kv.sharding.device_set)), jax.tree.structure(params)))
        key = (fn.__name__, tuple(sorted(static.items())),
               tuple(sorted((k, v.shape) for k, v in dev.items())), *held[2])
        with _STEP_LOCK:
            return self._cached_executable(key, fn, dev, **static)

    def _cached_executable(self, key, fn, dev: dict, **static):
        exe = _EXECUTABLES.get(key)
        if exe is not None:
            _EXECUTABLES.move_to_end(key)
        else:
            jax.block_until_ready(list(_IN_FLIGHT))
            _IN_FLIGHT.clear()
            t0 = time.perf_counter()
            exe = self.lower_step(fn, dev, **static).compile()
            self.compile_s += time.perf_counter() - t0
            _EXECUTABLES[key] = exe
            while len(_EXECUTABLES) > MAX_EXECUTABLES:
                _EXECUTABLES.popitem(last=False)
        return exe

    def lower_step(self, fn, dev: dict, **static):
        """`fn` (`_sample_step` / `_verify_step`) lowered for this runner's params, cache (format
        pinned, donated) and the device batch `dev` (arrays or ShapeDtypeStructs)."""
        jitted = step_jit(fn, self.kv_format, self.params, self._batch_sharding, **static)
        return jitted.lower(self.params, self.kv_all, dev)

    def sync_page_table(self, rows) -> jax.Array:
        """The device page table brought up to date with `rows` (`batch.RequestRows`): the
        entries changed since the last sync are written in place (a padded bucket of them, so
        few compiled sizes), or the whole table is sent when it is new or was resized."""
        whole, idx, val = rows.take_updates()
        table = self.page_table
        if whole or table is None or table.shape != rows.pages.shape or not rows.tracking:
            table = jax.device_put(np.array(rows.pages), self._batch_sharding)
            rows.tracking = True
        elif len(idx):
            check_unique("page table entries", idx)
            n = bucket(len(idx), 256)
            idx = _padded(idx, n, rows.pages.size)  # (indices past the end: dropped)
            val = _padded(val, n, 0)
            table = self._set_entries(table, self.step_arg(idx), self.step_arg(val))
        self.page_table = table
        return table

    def _device_batch(self, batch: StepBatch, prev: Launched | None = None) -> dict:
        """The step's inputs on the device (dispatched, not waited for), with the persistent
        page table if the batch indexes it, and the pending tokens read from `prev`'s outputs
        on the device where `batch.token_src` says so."""
        arrays = {k: np.asarray(v) for k, v in batch.arrays().items()}
        if self._replicated is None:
            # the batch's new host arrays, transferred by the step's own call
            dev = dict(arrays)
        else:
            # one transfer for the whole batch (every input is 32-bit): packed on the host,
            # taken apart on the device
            spec = tuple((k, v.shape, v.dtype.str) for k, v in arrays.items())
            flat = np.concatenate([v.reshape(-1).view(np.int32) for v in arrays.values()])
            dev = dict(self._unpack_inputs(self.step_arg(flat), spec))
        if batch.page_table is not None:
            dev["page_table"] = self.sync_page_table(batch.page_table)
        if batch.token_src is not None:
            if prev is None:
                raise ValueError("the batch reads pending tokens of a previous step; none was given")
            # (a new int32 array of `build_batch`)
            dev["tokens"] = self._merge_tokens(dev["tokens"], self.step_arg(batch.token_src),
                                               prev.packed)
        return dev

    def expert_dispatch(self, num_tokens: int) -> str:
        """How a step of `num_tokens` (padded) tokens reaches the MoE experts
        (`moe.expert_dispatch`; "" for a dense model)."""
        if self.cfg.moe is None:
            return ""
        return moe.expert_dispatch(num_tokens, self.plan.expert_mesh, self.cfg.moe,
                               self.cfg.hidden_size, jnp.dtype(jnp_dtype(self.cfg)).itemsize)

    def launch(self, batch: StepBatch, num_top: int = 0, prev: Launched | None = None, *,
               wait_inputs: bool = False) -> Launched:
        """Dispatch a step (sample, or verify when the batch carries draft trees) without
        waiting for it: its outputs stay on the device (`fetch` brings them back). The cache is
        updated in order, so a later launch, or any cache operation, sees this step's writes.
        `prev`: the launched step whose sampled tokens this batch reads (`batch.token_src`).
        wait_inputs: wait for the inputs' transfer (so that `timings.h2d_s` measures it; the
        host then spends that time waiting: `sample` and `verify` do not)."""
        t0 = time.perf_counter()
        check_unique("KV slots of the step's tokens", batch.slots)
        with _STEP_LOCK:
            dev = self._device_batch(batch, prev)
        if wait_inputs:
            jax.block_until_ready(dev)
        t1 = time.perf_counter()
        kind = "verify" if batch.draft is not None and batch.draft.tokens is not None else "sample"
        extra = {"routed": True} if self.routed else {}
        with _STEP_LOCK:
            if kind == "verify":
                exe = self._executable(_verify_step, dev, cfg=self.cfg, layout=batch.layout,
                                       plan=self.plan, **extra)
            else:
                exe = self._executable(_sample_step, dev, cfg=self.cfg, layout=batch.layout,
                                       plan=self.plan, num_top=num_top, **extra)
            t2 = time.perf_counter()
            self.kv_all, packed = exe(self.params, self.kv_all, dev)
            _IN_FLIGHT.append(packed)
        routed = (batch.layout.num_rows, *self.routed) if self.routed else None
        return Launched(kind, batch.layout, num_top, packed, h2d_s=t1 - t0,
                        dispatch_s=time.perf_counter() - t2, routed=routed)

    def fetch(self, launched: Launched):
        """A launched step's outputs on the host, in one transfer: `sample_outputs` or
        `verify_outputs` of it. Sets `timings`: device = dispatch plus waiting for the step,
        d2h = the transfer."""
        t0, c0 = time.perf_counter(), time.thread_time()
        launched.packed.block_until_ready()
        t1 = time.perf_counter()
        self.wait_cpu_s += time.thread_time() - c0
        packed = to_host(launched.packed)
        t2 = time.perf_counter()
        self.timings = StepTimings(launched.h2d_s, launched.dispatch_s + t1 - t0, t2 - t1, t1 - t0)
        if launched.routed is not None:
            n = math.prod(launched.routed)
            packed, self.routed_experts = packed[:-n], packed[-n:].reshape(launched.routed)
        if launched.kind == "verify":
            return verify_outputs(packed, launched.layout)
        return sample_outputs(packed, launched.layout, launched.num_top)

    def sample(self, batch: StepBatch, num_top: int = 0):
        """Run a step and sample one token per row; host arrays (tokens [rows], logprobs
        [rows], top-logprobs or None)."""
        return self.fetch(self.launch(batch, num_top))

    def verify(self, batch: StepBatch):
        """Run a speculative step; returns host arrays (tokens [n_dec, q], logprobs [n_dec, q],
        num_accepted [n_dec], accepted_nodes [n_dec, q-1]) and the prefill (tokens, logprobs)."""
        return self.fetch(self.launch(batch))

    def move_slots(self, src, dst) -> None:
        """Copy the K/V at cache slots src to slots dst (all layers): compacts an accepted tree
        path into consecutive positions. Padded to a bucket of sizes (few compiled variants)."""
        if len(src):
            n = bucket(len(src), 64)
            end = self.num_pages * self.page_size
            check_unique("accepted draft slots", dst, hi=end)
            src, dst = _padded(src, n, 0), _padded(dst, n, end)
            with _STEP_LOCK:
                self.kv_all = self._move_slots(self.kv_all, self.step_arg(src),
                                               self.step_arg(dst))

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = self.device_input([p[0] for p in pairs], jnp.int32)
        check_unique("page copies", [p[1] for p in pairs])
        dst = self.device_input([p[1] for p in pairs], jnp.int32)
        with _STEP_LOCK:
            self.kv_all = self._copy_pages(self.kv_all, src, dst)

    def read_kv(self, pages: list[int], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies [num_layers, num_kv_heads, num_tokens, head_dim] of a page table's tokens."""
        with _STEP_LOCK:
            kv = self._read_pages(self.kv_all, self.device_input(pages, jnp.int32))
        kv = to_host(kv)
        if self.cfg.mla is not None:  # latent rows as k [L, 1, n, W], an empty v
            return latent_rows_to_host(kv, num_tokens)
        L, P, S, C, D = kv.shape
        k, v = split_kv(kv.reshape(L, P * S, C, D)[:, :num_tokens])  # [L, n, Hkv_cache, D]
        k = np.ascontiguousarray(k[:, :, :: self.kv_repeat].transpose(0, 2, 1, 3))
        v = np.ascontiguousarray(v[:, :, :: self.kv_repeat].transpose(0, 2, 1, 3))
        return k, v

    def write_kv(self, pages: list[int], k: np.ndarray, v: np.ndarray) -> None:
        """Inverse of `read_kv` (k, v: [num_layers, num_kv_heads, n, head_dim])."""
        check_unique("imported KV pages", pages)
        if self.cfg.mla is not None:
            kv = latent_rows_to_pages(k, len(pages), self.page_size)
            with _STEP_LOCK:
                self.kv_all = self._write_pages(self.kv_all, self.device_input(pages, jnp.int32),
                                                self.device_input(kv, self.kv_all.dtype))
            return
        if self.kv_repeat > 1:
            k, v = np.repeat(k, self.kv_repeat, axis=1), np.repeat(v, self.kv_repeat, axis=1)
        L, H, n, D = k.shape
        S = self.page_size
        pad = len(pages) * S - n
        kv = interleave_kv(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))  # [L, n, 2H, D]
        kv = np.pad(kv, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(L, len(pages), S, 2 * H, D)
        with _STEP_LOCK:
            self.kv_all = self._write_pages(self.kv_all, self.device_input(pages, jnp.int32),
                                            self.device_input(kv, self.kv_all.dtype))
