"""Dropless expert MLPs over row blocks each owned by one expert: the grouped matmul GPUs and TPUs
run for prefill-sized batches.

XLA:GPU lowers `jax.lax.ragged_dot` to a dense GEMM masked by group, over a [rows, experts x
hidden] operand: experts times the flops and, at a prefill chunk's 65,536 (token, expert) rows,
gigabytes of temporaries. `blocked_experts` computes the same sums with ordinary batched matmuls:

  1. layout: the (token, slot) pairs whose expert is one of the local experts are placed in
     expert order into rows where each expert's group starts on a multiple of `block` rows (its
     size padded up to whole blocks; padding rows hold no pair), so every block of rows belongs
     to one expert (`block_layout`). The row count is static: M pairs over L experts fill at
     most ceil(M / block) + L blocks.
  2. experts: on a GPU, the Pallas (Triton) kernel `pallas.expert_gemm_gpu` (impl "pallas"),
     on a TPU the Pallas (Mosaic) kernel `pallas.expert_gemm_tpu` (impl "tpu"): per (block,
     output tile) the block's rows gathered from the tokens and its expert's weight tiles read
     where they lie in the stacks, blocks past the used ones skipped. Elsewhere, and for shapes
     a GPU kernel cannot tile (impl "xla"): a loop over the used blocks, `group` blocks an
     iteration (a dynamic trip count: the blocks the batch fills, not the static bound), that
     gathers each block's tokens and its expert's three weight matrices and runs the SwiGLU MLP
     as batched matmuls [group, block, d] x [group, d, f]; XLA:GPU writes each iteration's
     gathered weights out before its GEMMs read them (at a prefill chunk, twice the expert
     weights' bytes a layer beside the GEMMs' own reads), which the kernel does not.
     No token is dropped: padding only adds rows.
  3. combine: each pair reads its row back (pairs of other devices' experts read zeros) and the
     k pairs of a token are summed with their router weights in slot order (no scatter-add, so
     the sums do not depend on the order a device happens to run them in).

Temporaries: one output row per block row ([blocks x block, d]; the kernel also the expert
hidden rows [blocks x block, f]) and, in the loop, one group's weights, instead of the masked
GEMM's [rows, experts x d]. The flops are the routed ones plus the padding
(under one block per local expert).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from seer_jax.pallas import expert_gemm_gpu, expert_gemm_tpu

# blocked_experts' formulations: the XLA loop, and the expert GEMM kernels (compiled, or in
# Pallas's interpret mode on any backend)
IMPLS = ("xla", "pallas", "interpret", "tpu", "tpu_interpret")


def expert_swiglu(impl: str):
    """The expert GEMM kernel of a kernel `impl` (see IMPLS), as a function of the
    `expert_swiglu_gpu` arguments plus `interpret`."""
    if impl in ("tpu", "tpu_interpret"):
        fn = expert_gemm_tpu.expert_swiglu_tpu
    else:
        fn = expert_gemm_gpu.expert_swiglu_gpu
    return functools.partial(fn, interpret=impl.endswith("interpret"))

# rows per block (one expert's) and blocks per loop iteration on GPU: 256-row blocks pad an
# expert's group by at most 255 rows (at a prefill chunk's 512 rows per expert, under half a
# block on average) and read an expert's weights once per 256 of its rows; 8 blocks an
# iteration keep a few GEMMs of 2,048 rows in flight with one group's weights (8 x 3 x d x f)
BLOCK_ROWS = 256
GROUP_BLOCKS = 8


# set by `static_iterations`: blocked_experts runs this many loop iterations, unrolled
_STATIC_ITERATIONS: list[int] = []


@contextlib.contextmanager
def static_iterations(iterations: int):
    """Inside the block, `blocked_experts` traces its loop as `iterations` unrolled iterations
    instead of a loop over the blocks the batch fills: an analysis variant for cost analyses,
    which count a loop body once and cannot know a data-dependent trip count (pass
    `expected_iterations`). Its outputs are those of the first `iterations` groups of blocks
    only: never for running a model."""
    _STATIC_ITERATIONS.append(int(iterations))
    try:
        yield
    finally:
        _STATIC_ITERATIONS.pop()


def expected_blocks(num_tokens: int, k: int, num_experts: int, num_local: int,
                    block: int = BLOCK_ROWS) -> float:
    """The blocks `block_layout` fills on average on one device for `num_tokens` tokens choosing
    k of `num_experts` experts uniformly: its `num_local` experts' groups are
    Binomial(num_tokens, k / num_experts) pairs each, each padded to whole blocks."""
    n, p = num_tokens, k / num_experts
    if p >= 1:
        return num_local * -(-n // block)
    # E[ceil(X / block)] for X ~ Binomial(n, p), summed in log space
    log_q, log_p = math.log1p(-p), math.log(p)
    per_expert = sum(math.exp(math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
                              + x * log_p + (n - x) * log_q) * -(-x // block)
                     for x in range(n + 1))
    return num_local * per_expert


def expected_iterations(num_tokens: int, k: int, num_experts: int, num_local: int,
                        block: int = BLOCK_ROWS, group: int = GROUP_BLOCKS) -> int:
    """The loop iterations `blocked_experts` runs on one device (`expected_blocks`, rounded up
    to whole groups of `group` blocks)."""
    blocks = expected_blocks(num_tokens, k, num_experts, num_local, block)
    return -(-math.ceil(blocks - 1e-9) // group)


def sort_by_expert(ids_nk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order [N*k]: the flat (token, slot) pairs sorted by expert, stable; group sizes [E]).
    A counting sort (each pair's place: its expert's first row plus the pairs of that expert
    before it), the permutation a stable argsort gives: XLA:GPU sorts large arrays with CUB,
    whose workspace query needs an attached device, so a prefill-sized step would not compile
    ahead of time."""
    flat = ids_nk.reshape(-1)
    onehot = (flat[:, None] == jnp.arange(num_experts)[None, :]).astype(jnp.int32)  # [M, E]
    before = jnp.cumsum(onehot, axis=0) - onehot
    sizes = jnp.sum(onehot, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    rank = jnp.take_along_axis(before, flat[:, None], axis=1)[:, 0]
    place = starts[flat] + rank
    order = jnp.zeros_like(flat).at[place].set(jnp.arange(flat.shape[0], dtype=flat.dtype),
                                               unique_indices=True)
    return order, sizes


def inverse_permutation(order: jax.Array) -> jax.Array:
    """Where each element went: inv[order[i]] = i (gathering by it undoes the permutation)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                               unique_indices=True)


def num_blocks(num_pairs: int, num_local: int, block: int, group: int) -> int:
    """Static bound on the blocks `num_pairs` pairs over `num_local` experts fill, rounded up to
    whole groups."""
    blocks = -(-num_pairs // block) + num_local
    return -(-blocks // group) * group


def block_layout(ids_m: jax.Array, first: int | jax.Array, num_local: int, num_rows: int,
                 block: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Place the pairs of local experts first .. first + num_local into expert-owned blocks.

    Returns (row of each pair [M] (num_rows for a pair of another device's expert), pair of
    each row [num_rows] (M for a padding row), expert (local index) of each block
    [num_rows / block], blocks used (scalar)). Within an expert the pairs keep their order."""
    M = ids_m.shape[0]
    lid = ids_m - first
    local = (lid >= 0) & (lid < num_local)
    lid = jnp.where(local, lid, 0)
    onehot = ((lid[:, None] == jnp.arange(num_local)[None, :]) & local[:, None]).astype(jnp.int32)
    sizes = jnp.sum(onehot, axis=0)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - onehot, lid[:, None], axis=1)[:, 0]
    padded = -(-sizes // block) * block
    ends = jnp.cumsum(padded)
    starts = ends - padded
    row_of_pair = jnp.where(local, starts[lid] + rank, num_rows).astype(jnp.int32)
    pair_of_row = jnp.full((num_rows,), M, jnp.int32).at[row_of_pair].set(
        jnp.arange(M, dtype=jnp.int32), mode="drop", unique_indices=True)
    block_start = jnp.arange(num_rows // block) * block
    block_expert = jnp.sum(ends[None, :] <= block_start[:, None], axis=1)
    block_expert = jnp.minimum(block_expert, num_local - 1).astype(jnp.int32)
    return row_of_pair, pair_of_row, block_expert, ends[-1] // block


def blocked_experts(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array,
                    w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                    first: int | jax.Array = 0, block: int | None = None,
                    group: int = GROUP_BLOCKS, *, impl: str = "xla",
                    num_experts: int | None = None, rows_dtype=None) -> jax.Array:
    """Sum over each token's chosen experts among experts first .. first + len(w_gate) of
    weight * expert(x), float32 [N, d] (zero for tokens that chose none of them).

    impl "xla": the loop of batched matmuls (`block` rows a block, default BLOCK_ROWS, `group`
    blocks an iteration); "pallas": the GPU kernel (`pallas.expert_gemm_gpu`), "tpu": the TPU
    kernel (`pallas.expert_gemm_tpu`), both reading the weights in place, `block` defaulting to
    the kernel's `block_rows_for` the rows an expert receives on average; "interpret" and
    "tpu_interpret": those kernels in Pallas's interpret mode (any backend, for tests).
    num_experts: the experts the router chose among (default the local ones), for the kernels'
    cost estimates. rows_dtype (TPU kernel only): x_nd holds the tokens packed
    (`expert_gemm_tpu.pack_rows`) from rows of this dtype."""
    if impl not in IMPLS:
        raise ValueError(f"blocked_experts impl={impl!r}: want one of {IMPLS}")
    if rows_dtype is not None and not impl.startswith("tpu"):
        raise ValueError(f"blocked_experts: packed rows (rows_dtype) need the TPU kernel, not "
                         f"impl={impl!r}")
    x_nd, w_gate, w_up, w_down = map(jnp.asarray, (x_nd, w_gate, w_up, w_down))
    N, k = ids_nk.shape
    d = w_down.shape[2]
    num_local = w_gate.shape[0]
    M = N * k
    kernel = impl != "xla"
    if block is None and kernel:
        tpu = impl.startswith("tpu")
        block = (expert_gemm_tpu if tpu else expert_gemm_gpu).block_rows_for(
            N * k / (num_experts or num_local))
    elif block is None:
        block = BLOCK_ROWS
    nb = num_blocks(M, num_local, block, 1 if kernel else group)
    R = nb * block
    row_of_pair, pair_of_row, block_expert, used = block_layout(
        ids_nk.reshape(-1), first, num_local, R, block)
    # the token of each row (N: a padding row)
    token_of_row = jnp.where(pair_of_row < M, pair_of_row // k, N)
    if kernel:
        y = expert_swiglu(impl)(
            x_nd, token_of_row, block_expert, used, w_gate, w_up, w_down, block_rows=block,
            expected_blocks=expected_blocks(N, k, num_experts or num_local, num_local, block),
            expected_rows=M * num_local / (num_experts or num_local),
            **({} if rows_dtype is None else {"rows_dtype": rows_dtype}))
    else:
        # padding rows read a zero row appended after the tokens
        x_pad = jnp.concatenate([x_nd, jnp.zeros((1, d), x_nd.dtype)])
        y = _blocked_loop(x_pad, token_of_row, block_expert, used, w_gate, w_up, w_down,
                          block, group)
    # the pairs of other devices' experts take zeros (and rows of unused blocks are never read)
    local = (row_of_pair < R)[:, None]
    y_nkd = jnp.where(local, y[jnp.minimum(row_of_pair, R - 1)], 0).reshape(N, k, d)
    return jnp.sum(y_nkd.astype(jnp.float32) * weights_nk[:, :, None], axis=1)


def _blocked_loop(x_pad, token_of_row, block_expert, used, w_gate, w_up, w_down, block, group):
    """The "xla" formulation: a loop over the used blocks, `group` an iteration, each gathering
    its tokens and its experts' weights for batched matmuls -> [R, d]."""
    R = token_of_row.shape[0]
    d = x_pad.shape[1]
    nb = R // block
    rows_per_iter = group * block

    def body(i, y):
        start = i * rows_per_iter
        tok = jax.lax.dynamic_slice_in_dim(token_of_row, start, rows_per_iter)
        xb = x_pad[tok].reshape(group, block, d)
        e = jax.lax.dynamic_slice_in_dim(block_expert, i * group, group)
        g = jnp.einsum("gbd,gdf->gbf", xb, w_gate[e])
        u = jnp.einsum("gbd,gdf->gbf", xb, w_up[e])
        out = jnp.einsum("gbf,gfd->gbd", jax.nn.silu(g) * u, w_down[e])
        return jax.lax.dynamic_update_slice_in_dim(y, out.reshape(rows_per_iter, d), start, 0)

    iters = (used + group - 1) // group
    # the loop's buffer is filled from the tokens (its rows past the used blocks are never
    # read): a constant would let XLA:GPU schedule every layer's buffer at the start of the
    # step, all of them live at once (a layer's 8,192-token chunk: 0.33 GiB each on H100)
    y = jnp.broadcast_to(x_pad[0, 0], (R, d))
    if _STATIC_ITERATIONS:  # the analysis variant: a static trip count, unrolled
        for i in range(min(_STATIC_ITERATIONS[-1], nb // group)):
            y = body(i, y)
        return y
    return jax.lax.fori_loop(0, iters, body, y)
