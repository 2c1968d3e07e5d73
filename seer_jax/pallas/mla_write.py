"""Write new tokens' latent rows [c_kv, k_rope] into the paged latent cache (`mla_layout`).

slot = page_index * page_size + offset, as for the dense `write_kv`; slots < 0 are padding.

TPU: a token's offset in its page indexes a tiled dimension of the cache (its rows are the
second-minor axis), and Mosaic copies only whole tiles there ("offsets along tiled dimensions
must be aligned to tiles"). So the kernel read-modify-writes tiles: for a window of
`WRITE_WINDOW` tokens it DMAs each token's aligned tile of `tile_rows` rows (8 for 32-bit, 16
for bf16) and its new row into VMEM, merges into every tile the window's rows that fall in it
(so tokens sharing a tile all write the same merged tile), and DMAs the tiles back; windows run
one after another, so a later window reads what an earlier one wrote. A token's new row is
read the same way: the aligned tile of new rows holding it is copied in and the row picked out
by a masked sum (exact: one nonzero term). Slots are cleaned to >= 0 before the divmod
(`lax.div`/`lax.rem`, which lower from a CPU host).

GPU (Triton): grid (tokens,); each program stores the row's c_kv and k_rope lanes (two
power-of-two stores) into the aliased cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from seer_jax.errors import InputError
from seer_jax.pallas.checks import resolve_impl
from seer_jax.pallas.cost_estimates import latent_write_cost
from seer_jax.pallas.limits import TPU_SMEM_PREFETCH_BYTES, pow2
from seer_jax.pallas.mla_layout import latent_pool_4d, tpu_tile_rows
from seer_jax.pallas.mla_ref import write_latent_reference

WRITE_WINDOW = 8  # tokens whose tiles are in flight together (TPU)


def _check(latent_pages, new_latent, new_rope, slot_mapping, layer) -> None:
    rank = 3 if layer is None else 4
    if latent_pages.ndim != rank:
        want = "[total_pages, page_size, kv_lora_rank + qk_rope_head_dim]"
        if layer is not None:
            want = "[num_layers, " + want[1:] + " (a layer index is given)"
        raise InputError(f"latent_pages must be {want}, got {latent_pages.shape}")
    if new_latent.ndim != 2 or new_rope.ndim != 2 or new_latent.shape[0] != new_rope.shape[0]:
        raise InputError(f"new_latent/new_rope must be [T, kv_lora_rank] / [T, qk_rope_head_dim]"
                         f", got {new_latent.shape}, {new_rope.shape}")
    width = new_latent.shape[1] + new_rope.shape[1]
    if width != latent_pages.shape[-1]:
        raise InputError(f"new rows hold {new_latent.shape[1]} + {new_rope.shape[1]} values, "
                         f"the cache's rows {latent_pages.shape[-1]}")
    if slot_mapping.shape != (new_latent.shape[0],):
        raise InputError(f"slot_mapping must be [{new_latent.shape[0]}], got "
                         f"{slot_mapping.shape}")


def _clean_slots(slot_mapping, n_slots):
    s = slot_mapping.astype(jnp.int32)
    return jnp.where((s >= 0) & (s < n_slots), s, -1)


def _tpu_kernel(layer_ref, slots_ref, new_hbm, kv_in, kv_hbm, tiles, rows, sems, *,
                page_size: int, tile_rows: int, window: int):
    del kv_in  # aliased with kv_hbm
    num_tokens = slots_ref.shape[0]  # new_hbm holds them padded to whole tiles
    layer = layer_ref[0]
    ps, tr = jnp.int32(page_size), jnp.int32(tile_rows)
    row_iota = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, 1), 0)

    def chunk(c, carry):
        toks = []
        for i in range(window):
            t = c * window + i
            tc = jnp.minimum(t, num_tokens - 1)
            slot = slots_ref[tc]
            safe = jnp.maximum(slot, 0)
            page, off = jax.lax.div(safe, ps), jax.lax.rem(safe, ps)
            r = jax.lax.rem(off, tr)
            base = pl.multiple_of(off - r, tile_rows)
            ok = (t < num_tokens) & (slot >= 0)
            key = jnp.where(ok, safe - r, -1)  # the tile's first slot
            hbm_tile = kv_hbm.at[layer, page, pl.ds(base, tile_rows)]
            t_r = jax.lax.rem(tc, tr)
            new_tile = new_hbm.at[pl.ds(pl.multiple_of(tc - t_r, tile_rows), tile_rows)]
            toks.append(dict(
                ok=ok, r=r, key=key, t_r=t_r,
                read=pltpu.make_async_copy(hbm_tile, tiles.at[i], sems.at[0]),
                row=pltpu.make_async_copy(new_tile, rows.at[i], sems.at[1]),
                write=pltpu.make_async_copy(tiles.at[i], hbm_tile, sems.at[2])))
        for x in toks:
            pl.when(x["ok"])(x["read"].start)
            pl.when(x["ok"])(x["row"].start)
        for x in toks:
            pl.when(x["ok"])(x["read"].wait)
            pl.when(x["ok"])(x["row"].wait)
        new_rows = []  # token j's row [1, W], picked out of its tile of new rows
        for j, y in enumerate(toks):
            picked = jnp.where(row_iota == y["t_r"], rows[j].astype(jnp.float32), 0.0)
            new_rows.append(jnp.sum(picked, axis=0, keepdims=True).astype(tiles.dtype))
        for i, x in enumerate(toks):
            @pl.when(x["ok"])
            def _(i=i, x=x):
                tile = tiles[i]  # [tile_rows, W]
                for j, y in enumerate(toks):
                    sel = (row_iota == y["r"]) & (y["key"] == x["key"])
                    tile = jnp.where(sel, jnp.broadcast_to(new_rows[j], tile.shape), tile)
                tiles[i] = tile
        for x in toks:
            pl.when(x["ok"])(x["write"].start)
        for x in toks:
            pl.when(x["ok"])(x["write"].wait)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(num_tokens, window), chunk, 0)


def write_latent_tpu(latent_pages, new_latent, new_rope, slot_mapping, *,
                     interpret: bool = False, layer=None):
    pool, layer_arr = latent_pool_4d(latent_pages, layer)
    _, total_pages, page_size, width = pool.shape
    tile_rows = tpu_tile_rows(pool.dtype)
    num_tokens = new_latent.shape[0]
    if page_size % tile_rows:
        raise InputError(f"TPU latent write: page_size={page_size} is not a multiple of the "
                         f"{tile_rows}-row {pool.dtype} tile; use impl='reference'")
    if 4 * num_tokens > TPU_SMEM_PREFETCH_BYTES:
        raise InputError(f"TPU latent write: {num_tokens} tokens of slots exceed the scalar "
                         "memory bound; use impl='reference'")
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    new = jnp.concatenate([new_latent, new_rope], axis=-1).astype(pool.dtype)
    new = jnp.pad(new, ((0, -num_tokens % tile_rows), (0, 0)))  # whole tiles of new rows
    window = min(WRITE_WINDOW, max(1, num_tokens))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(1,),
        in_specs=[any_spec] * 2,
        out_specs=any_spec,
        scratch_shapes=[pltpu.VMEM((window, tile_rows, width), pool.dtype),
                        pltpu.VMEM((window, tile_rows, width), pool.dtype),
                        pltpu.SemaphoreType.DMA((3,))],
    )
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, page_size=page_size, tile_rows=tile_rows, window=window),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},  # operand indices count the scalar prefetch
        cost_estimate=latent_write_cost(num_tokens=num_tokens, width=width,
                                        tile_rows=tile_rows, dtype_bytes=pool.dtype.itemsize,
                                        kernel="seer_write_latent_tpu"),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="seer_write_latent_tpu",
    )(layer_arr, slots, new, pool)
    return out.reshape(latent_pages.shape)


def _gpu_kernel(slots_ref, layer_ref, new_c_ref, new_r_ref, kv_in, kv_ref, *, page_size: int):
    del kv_in  # aliased with kv_ref
    t = pl.program_id(0)
    slot = slots_ref[t]
    layer = layer_ref[0]
    rank, rope_dim = new_c_ref.shape[0], new_r_ref.shape[0]

    @pl.when(slot >= 0)
    def _():
        page, off = jax.lax.div(slot, page_size), jax.lax.rem(slot, page_size)
        kv_ref[layer, page, off, pl.ds(0, rank)] = new_c_ref[...]
        kv_ref[layer, page, off, pl.ds(rank, rope_dim)] = new_r_ref[...]


def write_latent_gpu(latent_pages, new_latent, new_rope, slot_mapping, *,
                     interpret: bool = False, layer=None):
    pool, layer_arr = latent_pool_4d(latent_pages, layer)
    _, total_pages, page_size, width = pool.shape
    rank, rope_dim = new_latent.shape[1], new_rope.shape[1]
    if rank != pow2(rank) or rope_dim != pow2(rope_dim):
        raise InputError(f"GPU latent write: kv_lora_rank={rank} and qk_rope_head_dim="
                         f"{rope_dim} must be powers of two; use impl='reference'")
    num_tokens = new_latent.shape[0]
    slots = _clean_slots(slot_mapping, total_pages * page_size)
    new_c = new_latent.astype(pool.dtype)
    new_r = new_rope.astype(pool.dtype)
    full = lambda x: pl.BlockSpec(x.shape, lambda t: (0,) * x.ndim)
    whole = pl.BlockSpec(pool.shape, lambda t: (0, 0, 0, 0))
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, page_size=page_size),
        grid=(num_tokens,),
        in_specs=[full(slots), full(layer_arr), pl.BlockSpec((None, rank), lambda t: (t, 0)),
                  pl.BlockSpec((None, rope_dim), lambda t: (t, 0)), whole],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={4: 0},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        cost_estimate=latent_write_cost(num_tokens=num_tokens, width=width, tile_rows=0,
                                        dtype_bytes=pool.dtype.itemsize,
                                        kernel="seer_write_latent_gpu"),
        interpret=interpret,
        name="seer_write_latent_gpu",
    )(slots, layer_arr, new_c, new_r, pool)
    return out.reshape(latent_pages.shape)


def write_latent(
    latent_pages: jax.Array,  # [total_pages, page_size, kv_lora_rank + qk_rope_head_dim]
    new_latent: jax.Array,  # [T, kv_lora_rank] compressed latents c_kv (after their norm)
    new_rope: jax.Array,  # [T, qk_rope_head_dim] RoPE keys (RoPE applied)
    slot_mapping: jax.Array,  # [T] int32, -1 = padding token (not written)
    *,
    impl: str = "auto",
    interpret: bool = False,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Return latent_pages with token t's row [c_kv, k_rope] at slot `slot_mapping[t]`.

    Pure function: call it inside a jit that donates the cache and XLA updates it in place (the
    kernels alias input and output). Two tokens must not share a slot. With `layer`,
    latent_pages is the whole cache [num_layers, ...] and that layer is written.
    """
    _check(latent_pages, new_latent, new_rope, slot_mapping, layer)
    which = resolve_impl(impl)
    if which == "reference":
        return write_latent_reference(latent_pages, new_latent, new_rope, slot_mapping, layer)
    if which == "tpu":
        return write_latent_tpu(latent_pages, new_latent, new_rope, slot_mapping,
                                interpret=interpret, layer=layer)
    return write_latent_gpu(latent_pages, new_latent, new_rope, slot_mapping,
                            interpret=interpret, layer=layer)
