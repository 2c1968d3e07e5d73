"""GPU Pallas (Triton lowering) expert SwiGLU over expert-owned row blocks, weights read in place.

The rows arrive in the layout `grouped_matmul.block_layout` makes: blocks of `block_rows` rows,
each owned by one expert (`block_expert[b]`, a local index), the used blocks first (`used`, a
scalar: the blocks past it hold no pair). Two calls:

  gate/up: grid (blocks, f / block_n). A program of a used block reads its expert's id and its
      rows' token indices, then loops over the hidden dim in `block_k` slices: the rows' slice
      gathered from the tokens by index (no permuted copy of the tokens is written) and the
      expert's gate and up tiles, read where they lie in the [E, d, f] stacks (no copy of an expert out of the
      stack), into two float32 accumulators; it writes silu(gate) * up in the rows' dtype.
  down: grid (blocks, d / block_n), the same over the expert hidden dim into [rows, d].

A program past `used` does nothing (`pl.when`); its output rows are never read. No row is dropped:
the layout pads an expert's rows up to whole blocks; the padding rows' loads and stores are
masked (no memory access; they compute as zeros), and the outputs of padding rows are
unspecified (never read). Interpret mode gathers the tokens without the mask (same values).

The cost estimate counts each block's GEMMs as XLA's cost analysis counts a GEMM it emits: every
operand and the output once (a block's real rows, its expert's weight matrices and its output
rows once per block, so an expert with two blocks counts its weights twice), over the blocks and
rows the caller expects (uniform routing's averages, `grouped_matmul.expected_blocks`), since
the used count is data.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from seer_jax.pallas.cost_estimates import expert_gemm_cost
from seer_jax.pallas.expert_blocks import check_block_call

# tiles: 64-wide slices of the contraction and 8 warps; a block's rows times the output tile
# kept to 32K float32 accumulators (the gate/up program holds two), the register footprint of the
# Triton matmul tutorial's 128 x 256 H100 tile (128 per thread at 8 warps); three pipeline stages
# of at most 48 KB of shared memory each. Block rows from 64 to 256 (`block_rows_for`). Untuned
# without a GPU.
BLOCK_ROWS = 128
MAX_BLOCK_ROWS = 256
ACCUMULATORS = 32 * 1024
BLOCK_K = 64
# output tiles at most 256 wide (a stage's weight tiles: 64 x 256 x 2 bytes per matrix), and 64
# wide for blocks under 64 rows (decode batches: the weights stream through more programs)
MAX_TILE_N = 256
SMALL_TILE_N = 64
MIN_TILE = 16  # Triton's smallest dot dimension


def block_rows_for(mean_rows: float) -> int:
    """Rows per block for experts receiving `mean_rows` rows on average: a power of two from 64
    to 256 holding 1.5 times the mean, so most experts fill one block (their weights read once)
    while a small batch pads little."""
    want = max(64, 1.5 * mean_rows)
    return min(MAX_BLOCK_ROWS, 1 << math.ceil(math.log2(want)))


def _tile(dim: int, preferred: int) -> int | None:
    """The largest power of two <= preferred dividing `dim`, at least MIN_TILE (None: none)."""
    t = preferred
    while t >= MIN_TILE:
        if dim % t == 0:
            return t
        t //= 2
    return None


def expert_gemm_problem(hidden: int, expert_hidden: int, block_rows: int) -> str | None:
    """Why the kernel cannot serve these shapes (None: it can)."""
    if block_rows < MIN_TILE or block_rows > MAX_BLOCK_ROWS or block_rows & (block_rows - 1):
        return (f"block_rows={block_rows} is not a power of two from {MIN_TILE} to "
                f"{MAX_BLOCK_ROWS}")
    for name, dim in (("hidden_size", hidden), ("expert intermediate size", expert_hidden)):
        if _tile(dim, BLOCK_K) is None:
            return f"{name}={dim} has no power-of-two tile >= {MIN_TILE} dividing it"
    return None


def _dot(a, b):
    # bf16 operands: tensor-core dots accumulating in float32; float32 ones at full precision
    return pltriton.dot(a, b, allow_tf32=False if a.dtype == jnp.float32 else None)


def _gate_up_kernel(tok_ref, x_ref, be_ref, used_ref, wg_ref, wu_ref, h_ref, *, block_k: int,
                    masked_gather: bool):
    b = pl.program_id(0)

    @pl.when(b < used_ref[0])
    def _():
        e = be_ref[b]
        num_tokens, d = x_ref.shape
        rows, bn = h_ref.shape
        # the block's rows gathered from the tokens by index (no permuted copy of them); padding
        # rows (token index num_tokens) are masked: no memory is read or written for them
        tok = tok_ref[...]
        real = (tok < num_tokens)[:, None]
        tok = jnp.minimum(tok, num_tokens - 1)

        def step(i, acc):
            g, u = acc
            if masked_gather:
                xk = pltriton.load(x_ref.at[tok, pl.ds(i * block_k, block_k)],
                                   mask=jnp.broadcast_to(real, (rows, block_k)), other=0)
            else:  # interpret mode gathers without a mask (same values)
                xk = x_ref[tok, pl.ds(i * block_k, block_k)]
                xk = jnp.where(real, xk, jnp.zeros_like(xk))
            g = g + _dot(xk, wg_ref[e, pl.ds(i * block_k, block_k), :])
            u = u + _dot(xk, wu_ref[e, pl.ds(i * block_k, block_k), :])
            return g, u

        zero = jnp.zeros((rows, bn), jnp.float32)
        g, u = jax.lax.fori_loop(0, d // block_k, step, (zero, zero))
        pltriton.store(h_ref, (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype),
                       mask=jnp.broadcast_to(real, (rows, bn)))


def _down_kernel(tok_ref, h_ref, be_ref, used_ref, wd_ref, y_ref, *, block_k: int,
                 num_tokens: int):
    b = pl.program_id(0)

    @pl.when(b < used_ref[0])
    def _():
        e = be_ref[b]
        rows, f = h_ref.shape
        real = (tok_ref[...] < num_tokens)[:, None]

        def step(i, acc):
            hk = pltriton.load(h_ref.at[:, pl.ds(i * block_k, block_k)],
                               mask=jnp.broadcast_to(real, (rows, block_k)), other=0)
            return acc + _dot(hk, wd_ref[e, pl.ds(i * block_k, block_k), :])

        acc = jax.lax.fori_loop(0, f // block_k, step,
                                jnp.zeros((rows, y_ref.shape[1]), jnp.float32))
        pltriton.store(y_ref, acc.astype(y_ref.dtype),
                       mask=jnp.broadcast_to(real, (rows, y_ref.shape[1])))


def expert_swiglu_gpu(x_nd: jax.Array, token_of_row: jax.Array, block_expert: jax.Array,
                      used: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                      block_rows: int = BLOCK_ROWS, expected_blocks: float | None = None,
                      expected_rows: float | None = None,
                      interpret: bool = False, num_warps: int = 8,
                      num_stages: int = 3) -> jax.Array:
    """SwiGLU of each row by its block's expert -> [R, d] in the tokens' dtype (R = blocks *
    block_rows; rows of blocks past `used`: unspecified; padding rows: zeros).

    x_nd [N, d] the tokens; token_of_row [R] int32 the token of each row (N: a padding row);
    block_expert [R / block_rows] int32 local expert of each block; used: scalar int32, the blocks
    in use (the first ones); w_gate, w_up [E, d, f], w_down [E, f, d] (read in place).
    expected_blocks, expected_rows: the used blocks and the real (non-padding) rows in them the
    cost estimate assumes (default: every block, every row)."""
    (R,) = token_of_row.shape
    d = x_nd.shape[1]
    E, _, f = w_gate.shape
    nb, blocks, rows = check_block_call(
        "GPU", expert_gemm_problem(d, f, block_rows), num_rows=R, block_rows=block_rows,
        hidden=d, block_expert_shape=block_expert.shape, w_gate_shape=w_gate.shape,
        w_up_shape=w_up.shape, w_down_shape=w_down.shape, expected_blocks=expected_blocks,
        expected_rows=expected_rows)
    be = block_expert.astype(jnp.int32)
    tok = token_of_row.astype(jnp.int32)
    used_arr = jnp.reshape(used, (1,)).astype(jnp.int32)
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    full = lambda shape: pl.BlockSpec(shape, lambda b, n: (0,) * len(shape))

    cap = MAX_TILE_N if block_rows >= 64 else SMALL_TILE_N

    def call(kernel, rows_in, weights, k_dim, n_dim, name):
        """One GEMM pass: grid (blocks, n_dim / tile), the block's rows in, [R, n_dim] out."""
        bn = _tile(n_dim, min(cap, ACCUMULATORS // (len(weights) * block_rows)))
        w_spec = pl.BlockSpec((E, k_dim, bn), lambda b, n: (0, 0, n))
        return pl.pallas_call(
            functools.partial(kernel, block_k=_tile(k_dim, BLOCK_K)),
            grid=(nb, n_dim // bn),
            in_specs=[pl.BlockSpec((block_rows,), lambda b, n: (b,)), rows_in,
                      full((nb,)), full((1,))] + [w_spec] * len(weights),
            out_specs=pl.BlockSpec((block_rows, bn), lambda b, n: (b, n)),
            out_shape=jax.ShapeDtypeStruct((R, n_dim), x_nd.dtype),
            compiler_params=params,
            cost_estimate=expert_gemm_cost(
                blocks=blocks, block_rows=block_rows, rows=rows, k_dim=k_dim, n_dim=n_dim,
                matrices=len(weights), in_bytes=x_nd.dtype.itemsize,
                w_bytes=weights[0].dtype.itemsize, out_bytes=x_nd.dtype.itemsize, kernel=name),
            interpret=interpret,
            name=name,
        )

    h = call(functools.partial(_gate_up_kernel, masked_gather=not interpret),
             full(x_nd.shape), (w_gate, w_up), d, f, "seer_expert_gate_up_gpu")(
        tok, x_nd, be, used_arr, w_gate, w_up)
    return call(functools.partial(_down_kernel, num_tokens=x_nd.shape[0]),
                pl.BlockSpec((block_rows, f), lambda b, n: (b, 0)), (w_down,), f, d,
                "seer_expert_down_gpu")(tok, h, be, used_arr, w_down)
