"""Pallas KV page writes into an aliased cache (updated in place under a donating jit).

Both kernels take the pool as one layer [P, S, 2 * Hkv, D] or the whole cache
[L, P, S, 2 * Hkv, D] with a layer index, so the engine's layer scan writes into the full cache
without slicing it. New K and V are interleaved first (`kv_layout.interleave_kv`), so a token is
one [2 * Hkv, D] row.

TPU: the cache stays in HBM (`pl.ANY`); each token's row is copied by one DMA to
(page, offset) = divmod(slot, page_size). The offset indexes the untiled page_size axis, so the
copy is legal for every page size and dtype (Mosaic requires dynamic offsets on the two tiled,
minor dimensions to be multiples of the tile). At most `WRITE_WINDOW` tokens' DMAs are in flight
(started together, then waited together), so a long prefill chunk does not queue thousands of
DMAs on one semaphore. Slots are cleaned to >= 0 before the divmod, and the kernel uses
`lax.div`/`lax.rem` (integer `//` lowers through `sign`, which asks the host for a TPU
generation and so cannot lower from a CPU host).

GPU (Triton): grid (tokens, KV heads); each program stores one head's [2, D] (K, V) rows through
a pointer into the aliased cache; nothing is staged in shared memory, so the pool size does not
matter (offsets are 64-bit for arrays over 4 GiB).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from seer_jax.errors import InputError
from seer_jax.pallas.cost_estimates import write_cost
from seer_jax.pallas.kv_layout import interleave_kv, pool_5d
from seer_jax.pallas.limits import gpu_write_kv_problem, tpu_write_kv_problem

WRITE_WINDOW = 16  # tokens whose DMAs are in flight together (TPU)


def _clean_slots(slot_mapping, n_slots):
    s = slot_mapping.astype(jnp.int32)
    return jnp.where((s >= 0) & (s < n_slots), s, -1)


def _tpu_kernel(layer_ref, slots_ref, new_hbm, kv_in, kv_hbm, sem, *, page_size: int,
                window: int):
    del kv_in  # aliased with kv_hbm
    num_tokens = new_hbm.shape[0]
    layer = layer_ref[0]
    ps = jnp.int32(page_size)

    def copy(t):
        tc = jnp.minimum(t, num_tokens - 1)
        slot = slots_ref[tc]
        safe = jnp.maximum(slot, 0)
        page, off = jax.lax.div(safe, ps), jax.lax.rem(safe, ps)
        ok = (t < num_tokens) & (slot >= 0)
        return ok, pltpu.make_async_copy(new_hbm.at[tc], kv_hbm.at[layer, page, off], sem.at[0])

    def each(t0, method):
        for i in range(window):
            ok, cp = copy(t0 + i)
            pl.when(ok)(getattr(cp, method))

    def chunk(c, carry):
        each(c * window, "start")
        each(c * window, "wait")
        return carry

    jax.lax.fori_loop(0, pl.cdiv(num_tokens, window), chunk, 0)


def write_kv_tpu(kv_pages, new_k, new_v, slot_mapping, *, interpret: bool = False, layer=None):
    kv5, layer_arr = pool_5d(kv_pages, layer)
    _, total_pages, page_size, _, head_dim = kv5.shape
    problem = tpu_write_kv_problem(head_dim=head_dim, max_tokens=new_k.shape[0])
    if problem:
        raise InputError(f"TPU KV-write kernel cannot lower: {problem}; use impl='reference'")
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    new = interleave_kv(new_k, new_v).astype(kv5.dtype)  # [T, 2 * Hkv, D]
    window = min(WRITE_WINDOW, max(1, new.shape[0]))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(1,),
        in_specs=[any_spec] * 2,
        out_specs=any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
    )
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, page_size=page_size, window=window),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(kv5.shape, kv5.dtype),
        input_output_aliases={3: 0},  # operand indices count the scalar prefetch
        cost_estimate=write_cost(num_tokens=new.shape[0], num_kv_heads=new.shape[1] // 2,
                                 head_dim=new.shape[2], dtype_bytes=new.dtype.itemsize,
                                 kernel="seer_write_kv_tpu"),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="seer_write_kv_tpu",
    )(layer_arr, slots, new, kv5)
    return out.reshape(kv_pages.shape)


def _gpu_kernel(slots_ref, layer_ref, new_ref, kv_in, kv_ref, *, page_size: int):
    del kv_in  # aliased with kv_ref
    t = pl.program_id(0)
    slot = slots_ref[t]
    layer = layer_ref[0]

    @pl.when(slot >= 0)
    def _():
        page, off = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        kv_ref[layer, page, off] = new_ref[...]  # [2, D]: this head's K and V


def write_kv_gpu(kv_pages, new_k, new_v, slot_mapping, *, interpret: bool = False, layer=None):
    kv5, layer_arr = pool_5d(kv_pages, layer)
    num_layers, total_pages, page_size, combined, head_dim = kv5.shape
    problem = gpu_write_kv_problem(head_dim=head_dim)
    if problem:
        raise InputError(f"GPU KV-write kernel cannot lower: {problem}; use impl='reference'")
    num_tokens = new_k.shape[0]
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    new = interleave_kv(new_k, new_v).astype(kv5.dtype)  # [T, 2 * Hkv, D]
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)
    row = pl.BlockSpec((None, 2, head_dim), lambda t, h: (t, h, 0))
    pool = pl.BlockSpec((num_layers, total_pages, page_size, 2, head_dim),
                        lambda t, h: (0, 0, 0, h, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, page_size=page_size),
        grid=(num_tokens, combined // 2),
        in_specs=[full(slots), full(layer_arr), row, pool],
        out_specs=pool,
        out_shape=jax.ShapeDtypeStruct(kv5.shape, kv5.dtype),
        input_output_aliases={3: 0},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        cost_estimate=write_cost(num_tokens=new.shape[0], num_kv_heads=new.shape[1] // 2,
                                 head_dim=new.shape[2], dtype_bytes=new.dtype.itemsize,
                                 kernel="seer_write_kv_gpu"),
        interpret=interpret,
        name="seer_write_kv_gpu",
    )(slots, layer_arr, new, kv5)
    return out.reshape(kv_pages.shape)
