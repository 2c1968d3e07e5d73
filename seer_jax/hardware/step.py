"""Compile the engine's own jitted step (`model_runner.step_function`) for a mesh slice of a
target chip, with abstract parameters, cache and batch (`jax.ShapeDtypeStruct` carrying their
shardings; no weights, nothing allocated).

Step kinds, each the largest of its kind the engine builds for the given limits:
  decode   max_num_seqs sequences of one token
  mixed    max_num_seqs decodes plus max_prefill_seqs prefill chunks over
           max_num_batched_tokens token slots
  verify   max_num_seqs draft trees of `tree_size` tokens (the pending token and its draft nodes)
           plus the prefill region of `mixed`
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seer_jax.engine.attention_backend import make_plan, mesh_platform
from seer_jax.engine.batch import DraftTree, Layout, Region, StepBatch, bucket
from seer_jax.engine.model_runner import (
    cache_format,
    cache_shape,
    cache_sharding,
    step_function,
    step_jit,
)
from seer_jax.errors import ConfigError
from seer_jax.hardware.targets import devices, get_target
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import (
    LOGICAL_AXES,
    jnp_dtype,
    key_kind,
    nest_params,
    param_shapes,
    resolve_layer_weights,
)
from seer_jax.model.sharding import ShardingRules, partition_spec

STEP_KINDS = ("decode", "mixed", "verify")


@dataclasses.dataclass(frozen=True)
class StepLimits:
    """The engine settings that fix a step's shapes (EngineConfig's names)."""

    page_size: int
    num_pages: int  # per instance (the whole slice's cache)
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_seqs: int
    max_model_len: int
    tree_size: int = 8  # verify: tokens per draft tree (pending token + draft nodes)


def step_layout(kind: str, lim: StepLimits) -> Layout:
    if kind not in STEP_KINDS:
        raise ConfigError(f"step kind={kind!r}; allowed: {', '.join(STEP_KINDS)}")
    pps = -(-lim.max_model_len // lim.page_size)
    pre = kind != "decode"
    # max_num_seqs=0: a prefill-only step
    return Layout(n_dec=lim.max_num_seqs, q_dec=lim.tree_size if kind == "verify" else 1,
                  n_pre=lim.max_prefill_seqs if pre else 0,
                  t_pre=bucket(lim.max_num_batched_tokens, 16, lim.max_num_batched_tokens)
                  if pre else 0, pps=pps)


def table_rows(lim: StepLimits) -> int:
    """Rows of the engine's persistent page table (`batch.RequestRows`) at these limits."""
    return max(lim.max_num_seqs, lim.max_prefill_seqs) + 2


def example_batch(layout: Layout, verify: bool) -> StepBatch:
    """A StepBatch of zeros with the layout's shapes (only its arrays' shapes and dtypes
    matter). As in the engine, the regions' page tables are rows of the persistent page table
    (`table_rows` below), which the step reads on the device."""
    n, r = layout.num_tokens, layout.num_rows
    i32 = lambda *s: np.zeros(s, np.int32)

    def region(slots):
        return Region(i32(slots + 1), i32(slots), None, 0, i32(slots))

    q = layout.q_dec
    draft = None
    if verify:
        draft = DraftTree(i32(layout.n_dec * q), i32(layout.n_dec, q - 1),
                          i32(layout.n_dec, q - 1), i32(layout.n_dec))
    return StepBatch(layout, i32(n), i32(n), i32(n), i32(r), np.zeros(r, np.float32),
                     np.ones(r, np.float32), i32(r), np.zeros(r, np.uint32), i32(r),
                     region(layout.n_dec) if layout.n_dec else None,
                     region(layout.n_pre) if layout.n_pre else None, draft)


def abstract_params(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules,
                    layer_weights: str = "stacked") -> dict:
    """The params as ShapeDtypeStructs with their shardings: layers stacked, or per layer
    (`layer_weights="per_layer"`, as the engine holds them on GPUs: each layer the keys of its
    kind, a dense MLP or a mixture of experts)."""
    dtype = jnp_dtype(cfg)

    def struct(shape, logical):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
            mesh, partition_spec(shape, logical, mesh, rules)))

    shapes = param_shapes(cfg)
    params = nest_params({name: struct(shape, LOGICAL_AXES[name])
                          for name, shape in shapes.items() if not name.startswith("layers/")})
    layer = {name.split("/", 1)[1]: (shape, LOGICAL_AXES[name])
             for name, shape in shapes.items() if name.startswith("layers/")}
    if layer_weights == "per_layer":
        params["layers"] = tuple({k: struct(shape[1:], logical[1:])
                                  for k, (shape, logical) in layer.items()
                                  if key_kind(k) in (None, kind)}
                                 for kind in cfg.layer_kinds)
    else:
        params["layers"] = {k: struct(shape, logical) for k, (shape, logical) in layer.items()}
    return params


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """One compiled step and the compiler's per-device numbers (bytes)."""

    kind: str
    impl: str
    target: str
    tp: int
    layout: Layout
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    kv_bytes: int  # the KV cache on one device
    compiled: object = dataclasses.field(repr=False, compare=False)
    # the estimates of the Pallas calls traced into the step (`cost_estimates.KernelEstimate`,
    # one per call site: a layer loop's body once, unrolled layers each)
    kernel_estimates: tuple = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        """Per-device bytes the step needs live: its arguments (weights, cache, batch), outputs
        not aliased onto donated arguments, temporaries and code."""
        return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
                + self.code_bytes)


def slice_mesh(target: str, tp: int) -> Mesh:
    return Mesh(np.array(devices(target, tp)), ("tp",))


def lower_step(cfg: ModelConfig, target: str, tp: int, lim: StepLimits, kind: str, *,
               impl: str = "auto", rules: ShardingRules = ShardingRules(),
               unroll: int | bool = 1, layer_weights: str = "auto"):
    """The engine step of `kind` on a tp-device slice of `target`, lowered (not compiled) as the
    engine jits it (`step_jit`: the cache donated, its device layout pinned row-major; the layer
    weights held as `layer_weights` resolves on the target's platform); with the attention plan,
    layout and the abstract cache."""
    get_target(target)
    mesh = slice_mesh(target, tp)
    layer_weights = resolve_layer_weights(layer_weights, mesh_platform(mesh))
    plan = make_plan(cfg, impl, mesh)
    layout = step_layout(kind, lim)
    shape = cache_shape(cfg, plan, lim.num_pages, lim.page_size)
    fmt = cache_format(cache_sharding(mesh, shape), len(shape))
    cache = jax.ShapeDtypeStruct(shape, jnp_dtype(cfg), sharding=fmt)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=replicated)
             for k, v in example_batch(layout, kind == "verify").arrays().items()}
    batch["page_table"] = jax.ShapeDtypeStruct((table_rows(lim), layout.pps), np.int32,
                                               sharding=replicated)
    params = abstract_params(cfg, mesh, rules, layer_weights)
    static = dict(cfg=cfg, layout=layout, plan=plan, unroll=unroll)
    if kind != "verify":
        static["num_top"] = 0
    fn = step_function("verify" if kind == "verify" else "sample")
    jitted = step_jit(fn, fmt, params, replicated, **static)
    return jitted.lower(params, cache, batch), plan, layout, cache


def compile_step(cfg: ModelConfig, target: str, tp: int, lim: StepLimits, kind: str, *,
                 impl: str = "auto", rules: ShardingRules = ShardingRules(),
                 unroll: int | bool = 1, layer_weights: str = "auto") -> CompiledStep:
    """Compile the step with the target's compiler; its memory_analysis() per device.
    `unroll=True` unrolls the layer scan (for cost analyses, which count a loop body once)."""
    from seer_jax.pallas import cost_estimates

    # a fresh trace, so that the kernels' estimates are recorded (a cached trace records none)
    jax.clear_caches()
    with jax.default_matmul_precision("default"), cost_estimates.collect() as estimates:
        lowered, plan, layout, cache = lower_step(cfg, target, tp, lim, kind, impl=impl,
                                                  rules=rules, unroll=unroll,
                                                  layer_weights=layer_weights)
        compiled = lowered.compile()
    m = compiled.memory_analysis()
    kv = math.prod(cache.sharding.shard_shape(cache.shape)) * cache.dtype.itemsize
    return CompiledStep(kind, plan.impl, target, tp, layout, int(m.argument_size_in_bytes),
                        int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                        int(m.temp_size_in_bytes), int(m.generated_code_size_in_bytes), kv,
                        compiled, tuple(estimates))



def _triton_calls(text: str) -> list[str]:
    """The op_name of every Triton call in an optimized GPU module's text."""
    target = 'custom_call_target="__gpu$xla.gpu.triton"'
    return [m.group(1) if (m := re.search(r'op_name="([^"]*)"', line)) else ""
            for line in text.splitlines() if target in line]


def step_cost(step: CompiledStep) -> dict[str, float]:
    """The compiler's flops and bytes accessed of a compiled step, per device, and the bytes
    attributed instruction by instruction over its optimized module (`bytes_attributed`,
    `hardware.hlo_bytes`). TPU: the executable's cost_analysis(), which counts each Mosaic call
    by its `pl.CostEstimate`. GPU (whose deviceless executables report none): XLA's
    HloCostAnalysis over the optimized GPU module, which counts a Triton call as nothing (its
    estimate is not in the HLO), plus the kernels' own estimates. The compiler's figures count a
    loop body once (compile with unroll=True); the attribution runs it by its trip count."""
    from seer_jax.hardware.hlo_bytes import attribute_bytes

    tpu = get_target(step.target).platform == "tpu"
    if tpu:
        cost = step.compiled.cost_analysis()
        text = step.compiled.as_text()
    else:
        from jax._src import xla_bridge
        from jax._src.lib import xla_client

        (module,) = step.compiled.runtime_executable().hlo_modules()
        cost = xla_client._xla.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module)
        text = module.to_string()
    if isinstance(cost, list | tuple):
        cost = cost[0]
    flops = max(0.0, float(cost.get("flops", 0.0)))
    nbytes = max(0.0, float(cost.get("bytes accessed", 0.0)))
    triton_call_bytes = None
    if not tpu and step.kernel_estimates:
        # each Triton call in the module at the mean estimate of its kernel's traced call
        # sites (one shape per step): a scanned layer body is traced once and unrolled (or
        # looped) by the compiler, and per-layer weights may trace fewer sites than calls too
        # (a model of a dense first layer and MoE layers: 4 sites of 2 kernels, 54 calls)
        calls = _triton_calls(text)
        triton_call_bytes = {}
        for name in {e.kernel for e in step.kernel_estimates}:
            mine = [e for e in step.kernel_estimates if e.kernel == name]
            n = sum(f"/{name}/" in f"/{op}/" for op in calls)
            flops += n * sum(e.flops for e in mine) / len(mine)
            nbytes += n * sum(e.bytes_accessed for e in mine) / len(mine)
            triton_call_bytes[name] = sum(e.bytes_accessed for e in mine) / len(mine)
    attributed = attribute_bytes(text, triton_call_bytes)
    if attributed.unknown_trip_counts:
        raise RuntimeError(f"loops of unknown trip count {attributed.unknown_trip_counts}: "
                           "cannot attribute their bytes")
    return {"flops": flops, "bytes_accessed": nbytes, "bytes_attributed": attributed.total,
            "attribution": attributed}
