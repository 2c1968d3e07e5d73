"""Which attention the engine runs, and how it runs on a tensor-parallel mesh.

Engine `impl` values:
  auto       the TPU kernel on TPU, the GPU kernel on GPU, `cpu` on CPU
  reference  the jnp reference attention everywhere (the yardstick for kernels and benchmarks)
  cpu        the fast CPU path: the decode loop of `cpu_attention` for plain decode steps, the
             reference (on gathered pages) for prefill and verify
  tpu, gpu   the Pallas kernels; on a CPU host they run in interpret mode (tests)

Kernels cannot be partitioned by XLA, so on a mesh every kernel call (KV write and attention)
runs under `shard_map` over the `tp` axis: query heads and KV heads are split, each shard holds
whole GQA groups. When the model has fewer KV heads than tp, the cache holds each KV head
`kv_repeat = tp // num_kv_heads` times (one per shard, as tpu-inference does) and new K/V are
repeated before the write. The kernels read the whole [L, P, S, 2 * Hkv, D] cache (K and V
interleaved per head, `seer_jax.pallas.kv_layout`) with a layer index, so the layer scan never
slices a layer out of the pool.

The reference runs the same way when the model has fewer KV heads than tp: left to XLA's
partitioner, a cache it cannot split by head stays replicated and every step gathers and
transposes a whole copy of it (18 GiB per device for Llama-3.1-405B at tp 16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from seer_jax.engine.types import ENGINE_IMPLS  # noqa: F401 (re-exported)
from seer_jax.errors import ConfigError
from seer_jax.model.config import ModelConfig
from seer_jax.pallas import ragged_paged_attention, write_kv
from seer_jax.pallas.limits import (
    gpu_attention_problem,
    gpu_write_kv_problem,
    tpu_attention_problem,
    tpu_write_kv_problem,
)
from seer_jax.pallas.sharded import sharded_ragged_paged_attention, sharded_write_kv

KERNEL_IMPLS = ("tpu", "gpu")


def mesh_platform(mesh: Mesh | None) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def resolve_engine_impl(impl: str, platform: str) -> str:
    """auto -> tpu / gpu / cpu by platform; other values as given (validated)."""
    if impl not in ENGINE_IMPLS:
        raise ConfigError(f"engine config impl={impl!r}; allowed: {', '.join(ENGINE_IMPLS)}")
    if impl != "auto":
        return impl
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "cpu")


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Static description of the engine's attention (a jit static argument)."""

    impl: str  # resolved: reference | cpu | tpu | gpu
    interpret: bool  # kernels on a CPU host
    mesh: Mesh | None  # shard_map over its "tp" axis when given (kernels; reference, Hkv < tp)
    tp: int
    kv_repeat: int  # cache KV heads = model KV heads * kv_repeat
    # MoE models: the mesh, whose "tp" axis splits the experts when over 1 and whose platform
    # picks the experts' formulation (`seer_jax.model.moe`; a tp=1 step compiled for another
    # platform than the host's)
    expert_mesh: Mesh | None = None

    @property
    def kernel(self) -> bool:
        return self.impl in KERNEL_IMPLS

    @property
    def wrapped(self) -> bool:
        """KV write and attention go through `kernel_write` / `kernel_attention` (the kernels,
        and the reference when it runs per shard)."""
        return self.kernel or self.mesh is not None


def make_plan(cfg: ModelConfig, impl: str, mesh: Mesh | None) -> AttentionPlan:
    """Resolve impl on the mesh's platform and decide how KV heads split over tp."""
    platform = mesh_platform(mesh)
    which = resolve_engine_impl(impl, platform)
    tp = mesh.shape.get("tp", 1) if mesh is not None else 1
    repeat = 1
    # kernels always run per shard; the reference too when XLA could not split the cache by head
    # and the heads repeat evenly over the shards (otherwise it stays with XLA's partitioner)
    hkv = cfg.num_kv_heads
    sharded = tp > 1 and (which in KERNEL_IMPLS or (
        which == "reference" and hkv < tp and tp % hkv == 0 and cfg.num_heads % tp == 0))
    if sharded:
        if cfg.num_heads % tp:
            raise ConfigError(f"impl={which!r} on tp={tp}: the model's {cfg.num_heads} query heads "
                              "do not split evenly; use a tp that divides them")
        if hkv % tp and tp % hkv:
            raise ConfigError(f"impl={which!r} on tp={tp}: {hkv} KV heads neither divide nor are "
                              "divided by tp")
        repeat = max(1, tp // hkv)
    return AttentionPlan(impl=which, interpret=which in KERNEL_IMPLS and platform == "cpu",
                         mesh=mesh if sharded else None, tp=tp, kv_repeat=repeat,
                         expert_mesh=mesh if cfg.moe is not None else None)


def check_kernel_shapes(plan: AttentionPlan, cfg: ModelConfig, *, page_size: int, dtype_bytes: int,
                        max_seqs: int, pages_per_seq: int, max_tokens: int) -> None:
    """ConfigError now (engine build) if the selected kernels cannot lower for these shapes."""
    if not plan.kernel:
        return
    hkv = cfg.num_kv_heads * plan.kv_repeat // plan.tp
    hq = cfg.num_heads // plan.tp
    if plan.impl == "tpu":
        problem = tpu_attention_problem(
            num_q_heads=hq, num_kv_heads=hkv, head_dim=cfg.head_dim, page_size=page_size,
            dtype_bytes=dtype_bytes, max_seqs=max_seqs, pages_per_seq=pages_per_seq,
            num_tokens=max_tokens) or tpu_write_kv_problem(head_dim=cfg.head_dim,
                                                           max_tokens=max_tokens)
    else:
        problem = (gpu_attention_problem(head_dim=cfg.head_dim, page_size=page_size)
                   or gpu_write_kv_problem(head_dim=cfg.head_dim))
    if problem:
        raise ConfigError(f"engine config impl={plan.impl!r} cannot run this model/config: "
                          f"{problem}; allowed alternatives: impl='reference' or 'cpu'")


def kernel_write(plan: AttentionPlan, kv_all, k, v, slots, layer):
    """Write new K/V [T, Hkv, D] of `layer` into the [L, P, S, 2 * Hkv_cache, D] cache in place."""
    if plan.kv_repeat > 1:
        k, v = jnp.repeat(k, plan.kv_repeat, axis=1), jnp.repeat(v, plan.kv_repeat, axis=1)
    kw = dict(impl=plan.impl, interpret=plan.interpret, layer=layer)
    if plan.mesh is None:
        return write_kv(kv_all, k, v, slots, **kw)
    return sharded_write_kv(plan.mesh, kv_all, k, v, slots, **kw)


def kernel_attention(plan: AttentionPlan, q, kv_all, kv_lens, pages, cu, num, *, layer,
                     tree_parents=None, max_q_len=None):
    """Ragged paged attention of packed q [T, Hq, D] over `layer` of the whole cache."""
    kw = dict(impl=plan.impl, interpret=plan.interpret, layer=layer, tree_parents=tree_parents)
    if plan.impl == "reference":
        kw["max_q_len"] = max_q_len
    if plan.mesh is None:
        return ragged_paged_attention(q, kv_all, kv_lens, pages, cu, num, **kw)
    return sharded_ragged_paged_attention(plan.mesh, q, kv_all, kv_lens, pages, cu, num, **kw)
