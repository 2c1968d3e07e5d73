"""Pallas KV page writes (TPU: one DMA per token into the aliased cache; GPU: one store per
(token, KV head)). Both alias the page buffers (input_output_aliases), so under a donating jit the
cache is updated in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _clean_slots(slot_mapping, n_slots):
    s = slot_mapping.astype(jnp.int32)
    return jnp.where((s >= 0) & (s < n_slots), s, -1)


def _tpu_kernel(slots_ref, nk_hbm, nv_hbm, k_in, v_in, k_hbm, v_hbm, sems, *, page_size):
    del k_in, v_in  # aliased with k_hbm / v_hbm
    num_tokens = nk_hbm.shape[0]

    def copies(t):
        slot = slots_ref[t]
        page, off = slot // page_size, slot % page_size
        return slot >= 0, (
            pltpu.make_async_copy(nk_hbm.at[t], k_hbm.at[:, page, off], sems.at[0]),
            pltpu.make_async_copy(nv_hbm.at[t], v_hbm.at[:, page, off], sems.at[1]),
        )

    def run(method):
        def body(t, c):
            ok, cps = copies(t)

            @pl.when(ok)
            def _():
                for cp in cps:
                    getattr(cp, method)()

            return c

        jax.lax.fori_loop(0, num_tokens, body, 0)

    run("start")  # all DMAs in flight together
    run("wait")


def write_kv_tpu(k_pages, v_pages, new_k, new_v, slot_mapping, *, interpret: bool = False):
    num_kv_heads, total_pages, page_size, head_dim = k_pages.shape
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(1,),
        in_specs=[any_spec] * 4,
        out_specs=[any_spec, any_spec],
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
    )
    return tuple(pl.pallas_call(
        functools.partial(_tpu_kernel, page_size=page_size),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},  # operand indices count the scalar prefetch
        interpret=pltpu.InterpretParams() if interpret else False,
        name="seer_write_kv_tpu",
    )(slots, new_k.astype(k_pages.dtype), new_v.astype(v_pages.dtype), k_pages, v_pages))


def _gpu_kernel(slots_ref, nk_ref, nv_ref, k_in, v_in, k_ref, v_ref, *, page_size):
    del k_in, v_in
    t = pl.program_id(0)
    h = pl.program_id(1)
    slot = slots_ref[t]

    @pl.when(slot >= 0)
    def _():
        page, off = slot // page_size, slot % page_size
        k_ref[h, page, off, :] = nk_ref[t, h, :]
        v_ref[h, page, off, :] = nv_ref[t, h, :]


def write_kv_gpu(k_pages, v_pages, new_k, new_v, slot_mapping, *, interpret: bool = False):
    num_kv_heads, total_pages, page_size, head_dim = k_pages.shape
    num_tokens = new_k.shape[0]
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    whole = lambda x: pl.BlockSpec(x.shape, lambda t, h: (0,) * x.ndim)
    return tuple(pl.pallas_call(
        functools.partial(_gpu_kernel, page_size=page_size),
        grid=(num_tokens, num_kv_heads),
        in_specs=[whole(slots), whole(new_k), whole(new_v), whole(k_pages), whole(v_pages)],
        out_specs=[whole(k_pages), whole(v_pages)],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        name="seer_write_kv_gpu",
    )(slots, new_k.astype(k_pages.dtype), new_v.astype(v_pages.dtype), k_pages, v_pages))
