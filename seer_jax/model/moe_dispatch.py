"""The all-to-all expert dispatch: under expert parallelism, each device sends its share of the
tokens' (token, expert) pairs to the devices that hold those experts and gets the outputs back.

The other dispatch (`moe.routed_experts_ep`'s default) keeps every token on every device, runs
each device's experts over the pairs that chose them and adds the devices' partial outputs with a
psum of [N, d] float32. The all-to-all moves (token, expert) rows instead: device s takes tokens
s*n .. (s+1)*n (n = N / ep), sorts its pairs by expert (so the pairs for each device are one
contiguous chunk), and

  1. sends each chunk to the device of its experts (`jax.lax.ragged_all_to_all`, the rows and
     their expert ids), every receiver placing the chunks of sources 0, 1, ... one after another
     (offsets from the [ep, ep] matrix of chunk sizes, one small all_gather);
  2. runs its experts over the rows it received (`expert_rows`);
  3. sends each output chunk back to where its rows came from (the reverse ragged all-to-all);
  4. sums each of its tokens' k outputs with the router weights in slot order, as the one-device
     `routed_experts` does, and all_gathers the [N, d] result in the model's dtype.

Per device it moves about 2 (N k / ep) d rows of the model's dtype each way in steps 1 and 3 and
N d for the all_gather, against 2 N d float32 for the psum's ring all-reduce (both times
(ep - 1) / ep): fewer bytes when k / ep is small (`dispatch_bytes`). XLA:CPU has no
ragged-all-to-all, so on the CPU `emulated_ragged_all_to_all` runs the collective's documented
semantics with an `all_to_all` of padded per-destination buffers (tests run the dispatch that
way); TPU and GPU compile the real one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from seer_jax.model.grouped_matmul import inverse_permutation, sort_by_expert


def dispatch_bytes(num_tokens: int, hidden: int, k: int, ep: int,
                   itemsize: int) -> dict[str, float]:
    """Bytes one device sends per MoE layer under each dispatch (the all-to-all's chunks at
    uniform routing: the expected share of a token's pairs bound for other devices)."""
    other = (ep - 1) / ep
    psum = 2 * other * num_tokens * hidden * 4  # ring all-reduce of the float32 partials
    rows = num_tokens * k / ep  # this device's pairs
    all_to_all = 2 * other * rows * (hidden * itemsize + 4) + other * num_tokens * hidden * itemsize
    return {"psum": psum, "all_to_all": all_to_all}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name: str):
    """`jax.lax.ragged_all_to_all` (one chunk per device) by an all_to_all of buffers padded to
    the operand's rows: for platforms that lack the collective (XLA:CPU)."""
    ep, cap = input_offsets.shape[0], operand.shape[0]
    r = jnp.arange(cap)
    src = jnp.clip(input_offsets[:, None] + r[None, :], 0, cap - 1)  # [ep, cap]
    got = jax.lax.all_to_all(operand[src], axis_name, 0, 0)  # [ep, cap, ...]: from each source
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst = jnp.where(r[None, :] < recv_sizes[:, None], offsets[:, None] + r[None, :],
                    output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(ep * cap, *operand.shape[1:]), mode="drop")


def all_to_all_experts(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array, *,
                       axis: str, ep: int, num_experts: int,
                       rows_fn: Callable[[jax.Array, jax.Array], jax.Array],
                       emulate: bool) -> jax.Array:
    """Inside shard_map over `axis` (tokens and routing replicated): sum over each token's chosen
    experts of weight * expert(x) -> [N, d] in x's dtype, replicated. `rows_fn(rows [R, d],
    local expert ids [R])` runs this device's experts over rows (zeros for ids outside them).
    The rows travel as x_nd holds them (a kernel's packed form, say); the outputs are rows_fn's,
    in its width and dtype."""
    exchange = emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
    N, k = ids_nk.shape
    d = x_nd.shape[1]
    local = num_experts // ep
    n = -(-N // ep)
    pad = n * ep - N
    s = jax.lax.axis_index(axis)
    x = jax.lax.dynamic_slice_in_dim(jnp.pad(x_nd, ((0, pad), (0, 0))), s * n, n)
    w = jax.lax.dynamic_slice_in_dim(jnp.pad(weights_nk, ((0, pad), (0, 0))), s * n, n)
    ids = jax.lax.dynamic_slice_in_dim(
        jnp.pad(ids_nk, ((0, pad), (0, 0)), constant_values=num_experts), s * n, n)
    m = n * k
    flat = ids.reshape(-1)  # padding tokens' pairs: expert num_experts, sorted last, not sent
    order, sizes = sort_by_expert(flat[:, None], num_experts + 1)
    send = jnp.sum(sizes[:num_experts].reshape(ep, local), axis=1).astype(jnp.int32)  # [ep]
    counts = jax.lax.all_gather(send, axis)  # [source, destination]
    before = jnp.arange(ep) < s
    in_off = jnp.cumsum(send) - send  # my chunk for each destination
    out_off = jnp.sum(jnp.where(before[:, None], counts, 0), axis=0)  # where it lands there
    recv = counts[:, s]
    recv_off = jnp.cumsum(recv) - recv  # each source's chunk here
    back_off = jnp.sum(jnp.where(before[None, :], counts, 0), axis=1)  # its chunk's place there
    R = ep * m  # at most every source's every pair
    # the receive buffers start as copies of a token value, not constants: XLA:GPU would
    # schedule a constant buffer of every layer at the start of the step, all live at once.
    # Rows past what arrives are never used: their expert ids stay -1 (no expert runs them)
    rows = exchange(x[order // k], jnp.broadcast_to(x[0, 0], (R, d)), in_off, send, out_off,
                    recv, axis_name=axis)
    row_ids = exchange(flat[order], jnp.full((R,), -1, jnp.int32), in_off, send, out_off, recv,
                       axis_name=axis)
    y = rows_fn(rows, row_ids - s * local)
    # (rows past what returns: the padding tokens' pairs, never used)
    y_sorted = exchange(y, jnp.broadcast_to(y[0, 0], (m, y.shape[1])), recv_off, recv,
                        back_off, send, axis_name=axis)
    # the pairs of no expert (id num_experts: padding) take zeros
    y_pairs = jnp.where((flat < num_experts)[:, None], y_sorted[inverse_permutation(order)], 0)
    out = jnp.sum(y_pairs.reshape(n, k, -1).astype(jnp.float32) * w[:, :, None], axis=1)
    out = jax.lax.all_gather(out.astype(y.dtype), axis, tiled=True)
    return out[:N]
