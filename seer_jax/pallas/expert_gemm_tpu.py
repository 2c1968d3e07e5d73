"""TPU Pallas (Mosaic) expert SwiGLU over expert-owned row blocks, weights read in place.

The same contract as `pallas.expert_gemm_gpu`: rows in the layout `grouped_matmul.block_layout`
makes (blocks of `block_rows` rows, each owned by one expert `block_expert[b]`, the `used` blocks
first). Two calls:

  gate/up: grid (blocks, f / tile_n). At a block's first output tile the kernel gathers its rows
      from the tokens, which stay in HBM, one row DMA per real row into a VMEM scratch (no
      permuted copy of the tokens is written; a padding row is zeroed instead; the rows' token
      indices reach SMEM by the pipeline, 8 blocks' at a time, so their number is not bounded
      by the 1 MiB of SMEM that scalar prefetch would hold them all in), and keeps them,
      unpacked once, for the block's other tiles. Each step multiplies them by its expert's gate and up tiles,
      fetched by the pipeline straight out of the [E, d, f] stacks (the expert index comes from
      `block_expert` by scalar prefetch), and writes silu(gate) * up in the rows' dtype.
  down: grid (blocks, d / tile_n), the block's hidden rows times its expert's down tile.

A bfloat16 row is not a whole 32-bit word per element, and DMAs move 32-bit rows: the wrapper
packs the tokens two halves to a word (`pack_rows`: element j of the first half in the low 16
bits, element j of the second in the high), and the kernel unpacks the gathered rows by shifts
(exact: a bfloat16 is the high half of a float32). Tokens are bfloat16 or float32.

Blocks past `used` compute nothing: their steps keep the last used block's weight tiles (so the
pipeline fetches nothing new) and send their output tile to a spare block past the R rows (the
caller never reads it), so a core of a megacore chip whose share of the grid is all unused
blocks cannot overwrite a used block with an unwritten buffer. Rows of unused blocks are
unspecified; padding rows compute as zeros.

The cost estimate is `expert_gemm_cost`, as for the GPU kernel: real rows read and written once,
each block's expert matrices once, over the blocks and rows the caller expects.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seer_jax.errors import InputError
from seer_jax.pallas.cost_estimates import expert_gemm_cost
from seer_jax.pallas.expert_blocks import check_block_call

# output tiles of at most 512 lanes; block rows a multiple of 16 (bfloat16 sublane packing) up
# to 512. A gate/up step holds the block's rows [block_rows, d] (packed and unpacked), two
# double-buffered weight tiles [d, tile_n] and its float32 products: at d = 4,096, 512-row
# blocks and 256-wide tiles, about 17 MiB of VMEM (limit 64). Untuned without a TPU.
MAX_TILE_N = 512
GATE_UP_TILE_N = 256
MAX_BLOCK_ROWS = 512
ROW_MULTIPLE = 16
LANES = 128
VMEM_LIMIT = 64 * 1024 * 1024


def block_rows_for(mean_rows: float) -> int:
    """Rows per block for experts receiving `mean_rows` rows on average: the smallest multiple
    of 16 at or above the mean plus four standard deviations of a Poisson count (about the
    binomial one of uniform routing), at most 512. An expert then fills one block but in rare
    batches, so its weights are read once, and the padding rows the MXU multiplies stay few (at
    a 2,048-token chunk, 128 rows an expert on average: 176-row blocks, where the GPU kernel's
    power of two would be 256)."""
    want = mean_rows + 4 * math.sqrt(max(mean_rows, 0.0))
    rows = ROW_MULTIPLE * max(1, math.ceil(want / ROW_MULTIPLE))
    return min(MAX_BLOCK_ROWS, rows)


def _tile(dim: int, preferred: int) -> int | None:
    """The largest multiple of 128 lanes <= preferred that divides `dim` by a power of two
    (None: dim is not a multiple of 128)."""
    if dim % LANES:
        return None
    t = preferred
    while t > LANES and dim % t:
        t //= 2
    return t if dim % t == 0 else LANES


def expert_gemm_problem(hidden: int, expert_hidden: int, block_rows: int) -> str | None:
    """Why the kernel cannot serve these shapes (None: it can)."""
    if block_rows % ROW_MULTIPLE or not ROW_MULTIPLE <= block_rows <= MAX_BLOCK_ROWS:
        return (f"block_rows={block_rows} is not a multiple of {ROW_MULTIPLE} from "
                f"{ROW_MULTIPLE} to {MAX_BLOCK_ROWS}")
    if hidden % (2 * LANES):
        return f"hidden_size={hidden} is not a multiple of {2 * LANES}"
    if expert_hidden % LANES:
        return f"expert intermediate size={expert_hidden} is not a multiple of {LANES}"
    return None


def pack_rows(x_nd: jax.Array) -> jax.Array:
    """[N, d] bfloat16 -> [N, d / 2] uint32: element j of the first half in the low 16 bits,
    element j of the second half in the high 16 bits (32-bit rows pass unchanged)."""
    if x_nd.dtype.itemsize == 4:
        return x_nd
    half = x_nd.shape[1] // 2
    bits = jax.lax.bitcast_convert_type(x_nd, jnp.uint16).astype(jnp.uint32)
    return bits[:, :half] | (bits[:, half:] << 16)


def _unpack(words: jax.Array, dtype) -> jax.Array:
    """`pack_rows` undone for a block of gathered rows: [rows, d / 2] uint32 -> [rows, d]."""
    lo = jax.lax.bitcast_convert_type(words << 16, jnp.float32)
    hi = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.concatenate([lo.astype(dtype), hi.astype(dtype)], axis=1)


def _dot(a, b):
    # bf16 operands multiply once on the MXU (Mosaic refuses "highest" for them); float32 ones
    # at full precision
    precision = (jax.lax.Precision.HIGHEST if a.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _gate_up_kernel(be_ref, used_ref, tok_ref, x_hbm, wg_ref, wu_ref, h_ref, rows_ref, x_ref,
                    sem, *, num_tokens: int):
    b, n = pl.program_id(0), pl.program_id(1)
    block_rows = rows_ref.shape[0]

    # this block's tokens: row b % 8 of the 8 blocks' in SMEM (lax: jnp's % lowers to a sign
    # op, which Mosaic lowers only knowing the chip)
    tok_ref = tok_ref.at[jax.lax.rem(b, 8)]

    @pl.when(b < used_ref[0])
    def _():
        @pl.when(n == 0)
        def _gather():
            def copy(r):
                return pltpu.make_async_copy(x_hbm.at[pl.ds(tok_ref[r], 1)],
                                             rows_ref.at[pl.ds(r, 1)], sem.at[0])

            def start(r, carry):
                real = tok_ref[r] < num_tokens

                @pl.when(real)
                def _():
                    copy(r).start()

                @pl.when(jnp.logical_not(real))
                def _():
                    rows_ref[pl.ds(r, 1), :] = jnp.zeros((1, rows_ref.shape[1]), rows_ref.dtype)

                return carry

            def wait(r, carry):
                @pl.when(tok_ref[r] < num_tokens)
                def _():
                    copy(r).wait()

                return carry

            jax.lax.fori_loop(0, block_rows, start, 0)
            jax.lax.fori_loop(0, block_rows, wait, 0)
            # unpacked once a block, for all its output tiles
            rows = rows_ref[...]
            x_ref[...] = _unpack(rows, x_ref.dtype) if rows.dtype == jnp.uint32 else rows

        x = x_ref[...]
        g = _dot(x, wg_ref[...])
        u = _dot(x, wu_ref[...])
        h_ref[...] = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)


def _down_kernel(be_ref, used_ref, h_ref, wd_ref, y_ref):
    @pl.when(pl.program_id(0) < used_ref[0])
    def _():
        y_ref[...] = _dot(h_ref[...], wd_ref[...]).astype(y_ref.dtype)


def expert_swiglu_tpu(x_nd: jax.Array, token_of_row: jax.Array, block_expert: jax.Array,
                      used: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                      block_rows: int, expected_blocks: float | None = None,
                      expected_rows: float | None = None, interpret: bool = False,
                      rows_dtype=None) -> jax.Array:
    """SwiGLU of each row by its block's expert -> [R + block_rows, d] in the tokens' dtype
    (R = blocks * block_rows; the last block is the spare one unused blocks write to; rows of
    blocks past `used`: unspecified; padding rows: zeros; no copy slices the spare off). As
    `expert_gemm_gpu.expert_swiglu_gpu`; interpret=True runs the TPU simulator on any backend.
    rows_dtype=jnp.bfloat16: x_nd is already `pack_rows`'d ([N, d / 2] uint32), as the tokens
    travel packed through the expert-parallel all-to-all (one packed copy, not one a side)."""
    (R,) = token_of_row.shape
    if rows_dtype is not None:
        if jnp.dtype(rows_dtype) != jnp.bfloat16 or x_nd.dtype != jnp.uint32:
            raise InputError(f"packed rows: want uint32 words of bfloat16 rows, got {x_nd.dtype} "
                             f"words of {rows_dtype}")
        packed, dtype = x_nd, jnp.dtype(rows_dtype)
        N, d = x_nd.shape[0], 2 * x_nd.shape[1]
    else:
        packed, dtype = None, x_nd.dtype
        N, d = x_nd.shape
    f = w_gate.shape[2]
    nb, blocks, rows = check_block_call(
        "TPU", expert_gemm_problem(d, f, block_rows), num_rows=R, block_rows=block_rows,
        hidden=d, block_expert_shape=block_expert.shape, w_gate_shape=w_gate.shape,
        w_up_shape=w_up.shape, w_down_shape=w_down.shape, expected_blocks=expected_blocks,
        expected_rows=expected_rows)
    if dtype not in (jnp.bfloat16, jnp.float32):
        raise InputError(f"TPU expert GEMM kernel: tokens of dtype {dtype}, want bfloat16 "
                         "or float32")
    scalars = (block_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32))
    # the rows' tokens in SMEM 8 blocks at a time (Mosaic's blocks: 8 rows by the whole last
    # dim), not whole by scalar prefetch: a prefill chunk's rows would outgrow the 1 MiB
    tokens = jnp.pad(token_of_row.astype(jnp.int32).reshape(nb, block_rows),
                     ((0, -nb % 8), (0, 0)), constant_values=N)
    tok_spec = pl.BlockSpec((8, block_rows), lambda b, n, *_: (jax.lax.div(b, 8), 0),
                            memory_space=pltpu.SMEM)
    if packed is None:
        packed = pack_rows(x_nd)
    # blocks split over a megacore chip's cores, each core's output tiles in order; the
    # simulator runs the grid in order (it would take two cores' writes to the spare block for
    # a revisit)
    semantics = ("arbitrary", "arbitrary") if interpret else ("parallel", "arbitrary")

    def call(kernel, operand_specs, weights, k_dim, n_dim, tile_n, scratch, name):
        """One GEMM pass: grid (blocks, n_dim / tile), [R + block_rows, n_dim] out."""
        tn = _tile(n_dim, tile_n)
        last_n = n_dim // tn - 1

        def live(b, used_ref):
            return b < used_ref[0]

        def weight_index(b, n, be, used_ref):
            # past the used blocks: the last used block's last tile, already in VMEM
            last = jnp.maximum(used_ref[0] - 1, 0)
            return (be[jnp.minimum(b, last)], 0, jnp.where(live(b, used_ref), n, last_n))

        def out_index(b, n, be, used_ref):
            ok = live(b, used_ref)
            return jnp.where(ok, b, nb), jnp.where(ok, n, 0)

        w_spec = pl.BlockSpec((None, k_dim, tn), weight_index)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(nb, n_dim // tn),
            in_specs=operand_specs + [w_spec] * len(weights),
            out_specs=pl.BlockSpec((block_rows, tn), out_index),
            scratch_shapes=scratch)
        return pl.pallas_call(
            kernel, grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct((R + block_rows, n_dim), dtype),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=semantics, vmem_limit_bytes=VMEM_LIMIT),
            cost_estimate=expert_gemm_cost(
                blocks=blocks, block_rows=block_rows, rows=rows, k_dim=k_dim, n_dim=n_dim,
                matrices=len(weights), in_bytes=dtype.itemsize,
                w_bytes=weights[0].dtype.itemsize, out_bytes=dtype.itemsize, kernel=name),
            interpret=pltpu.InterpretParams() if interpret else False,
            name=name,
        )

    h = call(functools.partial(_gate_up_kernel, num_tokens=N),
             [tok_spec, pl.BlockSpec(memory_space=pl.ANY)], (w_gate, w_up), d, f,
             GATE_UP_TILE_N, [pltpu.VMEM((block_rows, packed.shape[1]), packed.dtype),
                              pltpu.VMEM((block_rows, d), dtype),
                              pltpu.SemaphoreType.DMA((1,))],
             "seer_expert_gate_up_tpu")(*scalars, tokens, packed, w_gate, w_up)

    def h_index(b, n, be, used_ref):
        return jnp.minimum(b, jnp.maximum(used_ref[0] - 1, 0)), 0

    return call(_down_kernel, [pl.BlockSpec((block_rows, f), h_index)], (w_down,), f, d,
                MAX_TILE_N, [], "seer_expert_down_tpu")(*scalars, h, w_down)
