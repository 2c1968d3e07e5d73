"""Pallas KV page writes into an aliased cache (updated in place under a donating jit).

Both kernels take the pool as one layer [Hkv, P, S, D] or the whole cache [L, Hkv, P, S, D] with
a layer index, so the engine's layer scan writes into the full cache without slicing it.

TPU: the cache stays in HBM (`pl.ANY`); each token's [Hkv, D] K and V rows are copied by DMA to
(page, offset) = divmod(slot, page_size). At most `WRITE_WINDOW` tokens' DMAs are in flight
(started together, then waited together), so a long prefill chunk does not queue thousands of
DMAs on two semaphores. Slots are cleaned to >= 0 before the divmod, and the kernel uses
`lax.div`/`lax.rem` (integer `//` lowers through `sign`, which asks the host for a TPU
generation and so cannot lower from a CPU host).

GPU (Triton): grid (tokens, KV heads); each program stores one [D] row of K and of V through a
pointer into the aliased cache; nothing is staged in shared memory, so the pool size does not
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
from seer_jax.pallas.attention_tpu import pool_5d
from seer_jax.pallas.limits import gpu_write_kv_problem, tpu_write_kv_problem

WRITE_WINDOW = 16  # tokens whose DMAs are in flight together (TPU)


def _clean_slots(slot_mapping, n_slots):
    s = slot_mapping.astype(jnp.int32)
    return jnp.where((s >= 0) & (s < n_slots), s, -1)


def _tpu_kernel(layer_ref, slots_ref, nk_hbm, nv_hbm, k_in, v_in, k_hbm, v_hbm, sems, *,
                page_size: int, window: int):
    del k_in, v_in  # aliased with k_hbm / v_hbm
    num_tokens = nk_hbm.shape[0]
    layer = layer_ref[0]
    ps = jnp.int32(page_size)

    def copies(t):
        slot = slots_ref[jnp.minimum(t, num_tokens - 1)]
        safe = jnp.maximum(slot, 0)
        page, off = jax.lax.div(safe, ps), jax.lax.rem(safe, ps)
        ok = (t < num_tokens) & (slot >= 0)
        return ok, (
            pltpu.make_async_copy(nk_hbm.at[jnp.minimum(t, num_tokens - 1)],
                                  k_hbm.at[layer, :, page, off], sems.at[0]),
            pltpu.make_async_copy(nv_hbm.at[jnp.minimum(t, num_tokens - 1)],
                                  v_hbm.at[layer, :, page, off], sems.at[1]),
        )

    def each(t0, method):
        for i in range(window):
            ok, cps = copies(t0 + i)

            def run(cps=cps):
                for cp in cps:
                    getattr(cp, method)()

            pl.when(ok)(run)

    def chunk(c, carry):
        each(c * window, "start")
        each(c * window, "wait")
        return carry

    jax.lax.fori_loop(0, pl.cdiv(num_tokens, window), chunk, 0)


def write_kv_tpu(k_pages, v_pages, new_k, new_v, slot_mapping, *, interpret: bool = False,
                 layer=None):
    k5, v5, layer_arr = pool_5d(k_pages, v_pages, layer)
    _, _, total_pages, page_size, head_dim = k5.shape
    problem = tpu_write_kv_problem(head_dim=head_dim, max_tokens=new_k.shape[0])
    if problem:
        raise InputError(f"TPU KV-write kernel cannot lower: {problem}; use impl='reference'")
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    window = min(WRITE_WINDOW, max(1, new_k.shape[0]))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(1,),
        in_specs=[any_spec] * 4,
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    k_out, v_out = pl.pallas_call(
        functools.partial(_tpu_kernel, page_size=page_size, window=window),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k5.shape, k5.dtype),
                   jax.ShapeDtypeStruct(v5.shape, v5.dtype)],
        input_output_aliases={4: 0, 5: 1},  # operand indices count the scalar prefetch
        interpret=pltpu.InterpretParams() if interpret else False,
        name="seer_write_kv_tpu",
    )(layer_arr, slots, new_k.astype(k5.dtype), new_v.astype(v5.dtype), k5, v5)
    if k_pages.ndim == 4:
        return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
    return k_out, v_out


def _gpu_kernel(slots_ref, layer_ref, nk_ref, nv_ref, k_in, v_in, k_ref, v_ref, *,
                page_size: int):
    del k_in, v_in  # aliased with k_ref / v_ref
    t = pl.program_id(0)
    slot = slots_ref[t]
    layer = layer_ref[0]

    @pl.when(slot >= 0)
    def _():
        page, off = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        head_dim = nk_ref.shape[-1]
        k_ref[layer, page, off, pl.ds(0, head_dim)] = nk_ref[...]
        v_ref[layer, page, off, pl.ds(0, head_dim)] = nv_ref[...]


def write_kv_gpu(k_pages, v_pages, new_k, new_v, slot_mapping, *, interpret: bool = False,
                 layer=None):
    k5, v5, layer_arr = pool_5d(k_pages, v_pages, layer)
    num_layers, num_kv_heads, total_pages, page_size, head_dim = k5.shape
    problem = gpu_write_kv_problem(head_dim=head_dim)
    if problem:
        raise InputError(f"GPU KV-write kernel cannot lower: {problem}; use impl='reference'")
    num_tokens = new_k.shape[0]
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    full = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)
    row = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
    pool = pl.BlockSpec((num_layers, None, total_pages, page_size, head_dim),
                        lambda t, h: (0, h, 0, 0, 0))
    k_out, v_out = pl.pallas_call(
        functools.partial(_gpu_kernel, page_size=page_size),
        grid=(num_tokens, num_kv_heads),
        in_specs=[full(slots), full(layer_arr), row, row, pool, pool],
        out_specs=[pool, pool],
        out_shape=[jax.ShapeDtypeStruct(k5.shape, k5.dtype),
                   jax.ShapeDtypeStruct(v5.shape, v5.dtype)],
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="seer_write_kv_gpu",
    )(slots, layer_arr, new_k.astype(k5.dtype), new_v.astype(v5.dtype), k5, v5)
    if k_pages.ndim == 4:
        return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)
    return k_out, v_out
