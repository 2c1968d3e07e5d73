"""Mixture-of-experts MLP: a float32 router and dropless experts by grouped matmul.

`route` picks each token's k experts and their weights (`MoeConfig` describes the routers);
`routed_experts` runs them without a capacity factor: the N*k (token, expert) pairs are sorted by
expert and each expert's contiguous rows go through its SwiGLU MLP in one `jax.lax.ragged_dot`
per projection (every token reaches every expert it chose; none is dropped or capped), then the
outputs return to token order and are summed with the router weights. `moe_mlp` adds the shared
experts.

Expert parallelism (`moe_mlp(..., mesh=)` on a mesh whose "tp" axis divides the experts): the
experts are split over "tp" (`ShardingRules.experts`), tokens and routing stay replicated (decode-
sized batches: every device sees all tokens), and under `shard_map` each device runs the rows of
its own experts (a contiguous block of the expert-sorted rows) through one ragged_dot per
projection; a `psum` over "tp" adds the devices' partial outputs. Attention keeps its tensor
parallelism on the same devices.

Decode-sized batches on TPU and GPU (at most `DENSE_MAX_TOKENS` tokens) run the other formulation,
`dense_experts`: every local expert over every token as one batched matmul per projection, each
output kept only where the router chose that expert (still dropless and exact). It reads each
expert's weights once, as the step must (at batch 128 and top-8 of 128 experts nearly every expert
is hit), with no sorted copy of the rows: the compilers lower ragged_dot poorly at such sizes
(XLA:GPU as a dense masked GEMM over all local experts with an [experts, rows, embed] operand;
XLA:TPU copies a stacked layer's expert weights out of the stack before its ragged dot, which it
does not fuse with the slice). Its extra flops (experts / k times the routed ones) stay under the
chips' flops per weight byte at these batch sizes. A batch whose N*k (token, expert) pairs are
at most half the experts (`use_sparse_experts`: batch 8 or less at top-8 of 128, the long tail of
a rollout) runs `sparse_experts` instead: only the distinct experts it chose, each over the N
tokens with its weights sliced out of the stack, the unused slots of a static bound skipped, so
the step reads the weights of the experts it hits (8 of 128 at batch 1), as the cost model counts.
A step's padding rows (`moe_mlp`'s token_mask False: the engine's bucket rows past the live
tokens) choose no expert (id `num_experts`), so a batch of 1 in a bucket of 8 rows still reads
only its own token's experts, and no grouped matmul or all-to-all carries a padding row.
Larger batches (prefill, verify) keep the grouped ragged_dot on the CPU; GPUs and TPUs run
`grouped_matmul.blocked_experts` (rows sorted into blocks each owned by one expert, an expert
GEMM kernel over the blocks gathering the rows and reading the weights in place,
`pallas.expert_gemm_gpu` / `pallas.expert_gemm_tpu`: XLA:GPU's masked-GEMM ragged_dot would need
gigabytes of temporaries at a prefill chunk, and libtpu's ragged dot copies a layer's expert
weights into its own layout and the rows into expert order and back; a TPU whose kernel cannot
tile the shapes keeps the ragged_dot). Parameters of one MoE layer (keys of a layer's params,
`MOE_KEYS`):
  router      [embed, experts]               float32 logits
  router_bias [experts]                      the choice's score correction (sigmoid routers)
  we_gate, we_up [experts, embed, moe_mlp]; we_down [experts, moe_mlp, embed]
  ws_gate, ws_up [embed, mlp]; ws_down [mlp, embed]   shared experts
  ws_router   [embed, 1]                     the shared experts' sigmoid gate
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from seer_jax.model.grouped_matmul import (
    blocked_experts,
    expert_swiglu,
    inverse_permutation,
    sort_by_expert,
)
from seer_jax.model.moe_config import MoeConfig
from seer_jax.model.moe_dispatch import all_to_all_experts, dispatch_bytes
from seer_jax.pallas import expert_gemm_gpu, expert_gemm_tpu
from seer_jax.pallas.expert_gemm_gpu import BLOCK_ROWS, expert_gemm_problem

EP_AXIS = "tp"

# key -> logical axes (without the leading "layers" axis)
MOE_AXES: dict[str, tuple[str | None, ...]] = {
    "router": ("embed", None),  # replicated: every device routes every token
    "router_bias": (None,),
    "we_gate": ("experts", "embed", "moe_mlp"),
    "we_up": ("experts", "embed", "moe_mlp"),
    "we_down": ("experts", "moe_mlp", "embed"),
    "ws_gate": ("embed", "mlp"),
    "ws_up": ("embed", "mlp"),
    "ws_down": ("mlp", "embed"),
    "ws_router": ("embed", None),
}
MOE_KEYS = frozenset(MOE_AXES)


def moe_shapes(moe: MoeConfig, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one MoE layer's parameters (keys of MOE_AXES that this config uses)."""
    d, E, f = hidden_size, moe.num_experts, moe.expert_intermediate_size
    shapes = {"router": (d, E), "we_gate": (E, d, f), "we_up": (E, d, f), "we_down": (E, f, d)}
    if moe.score_correction_bias:
        shapes["router_bias"] = (E,)
    if moe.shared_intermediate_size:
        fs = moe.shared_intermediate_size
        shapes.update({"ws_gate": (d, fs), "ws_up": (d, fs), "ws_down": (fs, d)})
    if moe.shared_gate:
        shapes["ws_router"] = (d, 1)
    return shapes


def route(h_nd: jax.Array, lp: dict[str, Any], moe: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] float32, expert ids [N, k] int32) of each token's chosen experts."""
    k = moe.num_experts_per_tok
    logits = jnp.dot(h_nd.astype(jnp.float32), lp["router"].astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    if moe.scoring == "softmax":
        weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
        if moe.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    else:
        scores = jax.nn.sigmoid(logits)
        choice = scores
        if moe.score_correction_bias:
            choice = choice + lp["router_bias"].astype(jnp.float32)
        if moe.n_group > 1:
            N, G = choice.shape[0], moe.n_group
            grouped = choice.reshape(N, G, moe.num_experts // G)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
            _, best = jax.lax.top_k(group_scores, moe.topk_group)
            keep = jnp.any(best[:, :, None] == jnp.arange(G)[None, None, :], axis=1)  # [N, G]
            choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(N, -1)
        _, ids = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if moe.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids.astype(jnp.int32)


def expert_mlp(x_md: jax.Array, sizes_e: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array) -> jax.Array:
    """SwiGLU of rows grouped by expert ([M, d], contiguous groups of `sizes_e` rows) -> [M, d]."""
    # the inputs' own precision whatever jax_default_matmul_precision says: libtpu's ragged dot
    # kernel refuses bf16 operands at "highest" (Mosaic: "Bad lhs type")
    dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes_e, precision=jax.lax.Precision.DEFAULT)
    g = dot(x_md, w_gate)
    u = dot(x_md, w_up)
    return dot(jax.nn.silu(g) * u, w_down)


def routed_experts(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array,
                   lp: dict[str, Any]) -> jax.Array:
    """Sum over each token's chosen experts of weight * expert(x), dropless -> [N, d] (id
    `num_experts`: no expert, a zero row)."""
    N, k = ids_nk.shape
    E = lp["we_gate"].shape[0]
    order, sizes = sort_by_expert(ids_nk, E + 1)  # the pairs of no expert sorted last
    y = expert_mlp(x_nd[order // k], sizes[:E], lp["we_gate"], lp["we_up"], lp["we_down"])
    # the rows past the groups (pairs of no expert) are dropped: those pairs keep zeros
    back = jnp.where(jnp.arange(N * k) < jnp.sum(sizes[:E]), order, N * k)
    y_nkd = jnp.zeros_like(y).at[back].set(y, mode="drop").reshape(N, k, -1)
    out = jnp.sum(y_nkd.astype(jnp.float32) * weights_nk[:, :, None], axis=1)
    return out.astype(x_nd.dtype)


# tokens up to which TPU and GPU run `dense_experts` (decode-sized batches: below the chips'
# flops per byte of bf16 weights, so the extra flops cost no time)
DENSE_MAX_TOKENS = 256


GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _platform(mesh: Mesh | None) -> str:
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def use_dense_experts(num_tokens: int, mesh: Mesh | None) -> bool:
    """Whether a step of `num_tokens` tokens runs `dense_experts` (TPU and GPU, decode-sized)."""
    return num_tokens <= DENSE_MAX_TOKENS and _platform(mesh) in ("tpu", *GPU_PLATFORMS)


def use_blocked_experts(num_tokens: int, mesh: Mesh | None,
                        w_gate: jax.Array | None = None) -> bool:
    """Whether a step of `num_tokens` tokens not run by `dense_experts` runs
    `grouped_matmul.blocked_experts` rather than the grouped ragged_dot: always on a GPU (XLA:GPU
    lowers the ragged_dot to a GEMM masked by group), on a TPU where its expert GEMM kernel
    tiles the weights `w_gate` (libtpu's ragged_dot copies each layer's expert weights into its
    own layout before reading them)."""
    platform = _platform(mesh)
    if platform in GPU_PLATFORMS:
        return True
    return platform == "tpu" and w_gate is not None and blocked_impl(w_gate, "tpu") == "tpu"


def blocked_impl(w_gate: jax.Array, platform: str = "gpu") -> str:
    """`grouped_matmul.blocked_experts`'s formulation on `platform` for these expert weights:
    the expert GEMM kernel where it can tile their shapes ("pallas": Triton on a GPU; "tpu":
    Mosaic), else the loop of batched matmuls ("xla")."""
    d, f = w_gate.shape[-2:]
    if platform == "tpu":
        return "xla" if expert_gemm_tpu.expert_gemm_problem(d, f, BLOCK_ROWS) else "tpu"
    return "xla" if expert_gemm_problem(d, f, BLOCK_ROWS) else "pallas"


def dense_experts(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, first: int | jax.Array = 0) -> jax.Array:
    """Sum over each token's chosen experts among experts first.. first + len(w_gate) of
    weight * expert(x), float32 [N, d]: every such expert over every token (a batched matmul
    per projection), the rows of experts a token did not choose zeroed before the down
    projection."""
    local = w_gate.shape[0]
    mine = ids_nk[:, :, None] == first + jnp.arange(local)[None, None, :]  # [N, k, local]
    combine = jnp.sum(jnp.where(mine, weights_nk[:, :, None], 0.0), axis=1)  # [N, local]
    g = jnp.einsum("nd,edf->enf", x_nd, w_gate)
    u = jnp.einsum("nd,edf->enf", x_nd, w_up)
    # the router weights scale each expert's hidden rows (zero where not chosen), and one
    # matmul contracting experts and hidden units sums the chosen experts' down projections
    h = jnp.where(combine.T[:, :, None] != 0,
                  (jax.nn.silu(g) * u).astype(jnp.float32) * combine.T[:, :, None], 0)
    return jnp.einsum("enf,efd->nd", h.astype(x_nd.dtype), w_down,
                      preferred_element_type=jnp.float32)


def use_sparse_experts(num_tokens: int, k: int, num_experts: int) -> bool:
    """Whether a step run by `dense_experts` runs `sparse_experts` instead: its N*k (token,
    expert) pairs are at most half the experts, so it hits under half of them (40% at N*k =
    experts / 2) and reading only those beats reading all."""
    return 2 * num_tokens * k <= num_experts


def sparse_experts(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array, first: int | jax.Array = 0,
                   impl: str = "xla", num_experts: int | None = None) -> jax.Array:
    """`dense_experts` reading only the experts the tokens chose, float32 [N, d]: the distinct
    chosen experts among first.. first + len(w_gate), sorted and padded to a static
    min(N*k, local) slots, each slot one expert over the N tokens (its weights sliced out of the
    stack) scaled by the router weights and added; a padding slot runs nothing (`lax.cond`), so
    no weights are read for it. The slots unroll (the compilers' cost analysis counts a loop
    body once).

    impl "pallas" (GPU), "tpu" (TPU) or an interpret one (`grouped_matmul.IMPLS`): the slots are
    the row blocks of the expert GEMM kernel (`pallas.expert_gemm_gpu` / `expert_gemm_tpu`),
    each block the N tokens (padded to 16 rows) through its slot's expert, weights read in
    place, the padding slots skipped, its cost estimate over the distinct experts N tokens hit
    on average rather than every slot; XLA:GPU would copy each slot's expert out of the stack
    before its GEMMs (or, for one row, write a weight-sized product out and reduce it)."""
    local = w_gate.shape[0]
    N, k = ids_nk.shape
    lid = ids_nk - first
    lid = jnp.where((lid >= 0) & (lid < local), lid, local)
    slots = min(N * k, local)
    chosen = jnp.unique(lid.ravel(), size=slots, fill_value=local)  # sorted; padding = local
    # [N, slots]: each token's router weight for the slot's expert (0: not chosen)
    combine = jnp.sum(jnp.where(lid[:, :, None] == chosen[None, None, :],
                                weights_nk[:, :, None], 0.0), axis=1)
    if impl != "xla":
        rows = max(expert_gemm_gpu.MIN_TILE, 1 << (N - 1).bit_length())
        token_of_row = jnp.tile(jnp.where(jnp.arange(rows) < N, jnp.arange(rows), N), slots)
        # a local expert is hit by one of N tokens choosing k of num_experts with probability
        # 1 - (1 - k / num_experts)^N
        hit = 1 - (1 - k / max(k, num_experts or local)) ** N
        y = expert_swiglu(impl)(
            x_nd, token_of_row, jnp.minimum(chosen, local - 1),
            jnp.sum(chosen < local, dtype=jnp.int32), w_gate, w_up, w_down, block_rows=rows,
            expected_blocks=min(slots, local * hit), expected_rows=min(slots, local * hit) * N)
        # [slots, N, d] (the TPU kernel's spare block past the slots dropped)
        y = y[:slots * rows].reshape(slots, rows, -1)[:, :N].astype(jnp.float32)
        # padding slots' rows are unspecified: dropped by the where, not multiplied by zero
        return jnp.sum(jnp.where((chosen < local)[:, None, None],
                                 y * combine.T[:, :, None], 0.0), axis=0)
    out = jnp.zeros((N, x_nd.shape[1]), jnp.float32)

    def run(e, c_n, out):
        pick = lambda w: jax.lax.dynamic_index_in_dim(w, e, keepdims=False)
        h = jax.nn.silu(x_nd @ pick(w_gate)) * (x_nd @ pick(w_up))
        h = (h.astype(jnp.float32) * c_n[:, None]).astype(x_nd.dtype)
        return out + jnp.dot(h, pick(w_down), preferred_element_type=jnp.float32)

    for s in range(slots):
        out = jax.lax.cond(chosen[s] < local, run, lambda e, c_n, out: out,
                           chosen[s], combine[:, s], out)
    return out


def local_experts(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, first: int | jax.Array = 0,
                  num_experts: int | None = None, impl: str = "xla") -> jax.Array:
    """A decode-sized batch's experts among first.. first + len(w_gate) (float32 [N, d]):
    `sparse_experts` (through the expert GEMM kernel where `impl` says so) where the batch hits
    few of the `num_experts` (default: the local ones), else `dense_experts`."""
    N, k = ids_nk.shape
    if use_sparse_experts(N, k, num_experts or w_gate.shape[0]):
        return sparse_experts(x_nd, weights_nk, ids_nk, w_gate, w_up, w_down, first, impl,
                              num_experts)
    return dense_experts(x_nd, weights_nk, ids_nk, w_gate, w_up, w_down, first)


def kernel_impl(mesh: Mesh | None, w_gate: jax.Array) -> str:
    """How the mesh's chips run the expert GEMMs of `sparse_experts` and `blocked_experts`: the
    kernel of `blocked_impl` on a GPU or TPU, "xla" elsewhere (the CPU)."""
    platform = _platform(mesh)
    return blocked_impl(w_gate, platform) if platform in (*GPU_PLATFORMS, "tpu") else "xla"


def expert_parallel(mesh: Mesh | None, num_experts: int) -> int:
    """How many devices the experts split over (1: no expert parallelism)."""
    ep = 1 if mesh is None else mesh.shape.get(EP_AXIS, 1)
    return ep if ep > 1 and num_experts % ep == 0 else 1


def expert_dispatch(num_tokens: int, mesh: Mesh | None, moe: MoeConfig, hidden_size: int,
                    itemsize: int) -> str:
    """How a step of `num_tokens` tokens reaches its experts: "local" (no expert parallelism),
    "psum" (every device's experts over all tokens, partial outputs added; always for
    decode-sized batches on TPU and GPU) or "all_to_all" (`moe_dispatch`: when it sends fewer
    bytes per device than the psum, `dispatch_bytes`)."""
    ep = expert_parallel(mesh, moe.num_experts)
    if ep == 1:
        return "local"
    if use_dense_experts(num_tokens, mesh):
        return "psum"
    sent = dispatch_bytes(num_tokens, hidden_size, moe.num_experts_per_tok, ep, itemsize)
    return "all_to_all" if sent["all_to_all"] < sent["psum"] else "psum"


def expert_rows(x_md: jax.Array, lid_m: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array, impl: str | None, rows_dtype=None) -> jax.Array:
    """SwiGLU of each row by its local expert lid_m (rows of other experts: zeros) -> [M, d]:
    `blocked_experts` in formulation `impl`, or (None) the grouped ragged_dot. rows_dtype: the
    rows arrive packed for the TPU kernel (`expert_gemm_tpu.pack_rows`) from this dtype."""
    M = x_md.shape[0]
    local = w_gate.shape[0]
    if impl is not None:
        ones = jnp.ones((M, 1), jnp.float32)
        return blocked_experts(x_md, ones, lid_m[:, None], w_gate, w_up, w_down, impl=impl,
                               rows_dtype=rows_dtype).astype(rows_dtype or x_md.dtype)
    mine = (lid_m >= 0) & (lid_m < local)
    order, sizes = sort_by_expert(jnp.where(mine, lid_m, local)[:, None], local + 1)
    y = expert_mlp(x_md[order], sizes[:local], w_gate, w_up, w_down)
    y = jnp.where((jnp.arange(M) < jnp.sum(sizes[:local]))[:, None], y, 0)
    return y[inverse_permutation(order)]


def routed_experts_ep(x_nd: jax.Array, weights_nk: jax.Array, ids_nk: jax.Array,
                      lp: dict[str, Any], mesh: Mesh, moe: MoeConfig) -> jax.Array:
    """`routed_experts` with the experts split over the mesh's "tp" axis (see the module doc)."""
    N, k = ids_nk.shape
    num_experts = lp["we_gate"].shape[0]
    ep = mesh.shape[EP_AXIS]
    local = num_experts // ep

    dense = use_dense_experts(N, mesh)
    blocked = not dense and use_blocked_experts(N, mesh, lp["we_gate"])
    impl = kernel_impl(mesh, lp["we_gate"])
    dispatch = expert_dispatch(N, mesh, moe, x_nd.shape[1], x_nd.dtype.itemsize)

    def body(x, w, ids, w_gate, w_up, w_down):
        if dispatch == "all_to_all":
            # the TPU kernel's bfloat16 rows travel packed (its DMAs gather 32-bit words): one
            # packed copy of the tokens here, not one of every received row on arrival
            packed = blocked and impl.startswith("tpu") and x.dtype == jnp.bfloat16
            return all_to_all_experts(
                expert_gemm_tpu.pack_rows(x) if packed else x, w, ids, axis=EP_AXIS, ep=ep,
                num_experts=num_experts,
                rows_fn=lambda rows, lid: expert_rows(rows, lid, w_gate, w_up, w_down,
                                                      impl if blocked else None,
                                                      x.dtype if packed else None),
                emulate=_platform(mesh) == "cpu")
        shard = jax.lax.axis_index(EP_AXIS)
        first = shard * local
        if dense:
            return jax.lax.psum(local_experts(x, w, ids, w_gate, w_up, w_down, first,
                                              num_experts, impl), EP_AXIS)
        if blocked:
            return jax.lax.psum(blocked_experts(x, w, ids, w_gate, w_up, w_down, first,
                                                impl=impl,
                                                num_experts=num_experts), EP_AXIS)
        order, sizes = sort_by_expert(ids, num_experts + 1)  # no expert: last
        start = jnp.sum(jnp.where(jnp.arange(num_experts + 1) < first, sizes, 0))
        local_sizes = jax.lax.dynamic_slice_in_dim(sizes, first, local)
        count = jnp.sum(local_sizes)
        # this device's rows (its experts' block of the sorted pairs) first, the rest after
        rows = (jnp.arange(N * k) + start) % (N * k)
        pairs = order[rows]
        y = expert_mlp(x[pairs // k], local_sizes, w_gate, w_up, w_down)
        y = jnp.where((jnp.arange(N * k) < count)[:, None], y, 0)
        y_nkd = jnp.zeros_like(y).at[pairs].set(y).reshape(N, k, -1)
        part = jnp.sum(y_nkd.astype(jnp.float32) * w[:, :, None], axis=1)
        return jax.lax.psum(part, EP_AXIS)

    experts = P(EP_AXIS, None, None)
    out = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), experts, experts, experts),
                        out_specs=P(), check_vma=False)(
        x_nd, weights_nk, ids_nk, lp["we_gate"], lp["we_up"], lp["we_down"])
    return out.astype(x_nd.dtype)


def moe_mlp(h_nd: jax.Array, lp: dict[str, Any], moe: MoeConfig, mesh: Mesh | None = None,
            token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """One MoE MLP over N tokens: (output [N, d], chosen expert ids [N, k] int32). With a `mesh`
    whose "tp" axis divides the experts, the experts run expert-parallel over it.
    `token_mask` [N] bool: False marks a padding row of the step, which reaches no expert (its
    routed output is zero; no expert's weights are read for it, and no row of a grouped matmul
    or of the all-to-all carries it); the ids returned are still the router's."""
    weights, ids = route(h_nd, lp, moe)
    run_ids = ids if token_mask is None else jnp.where(token_mask[:, None], ids, moe.num_experts)
    if expert_parallel(mesh, moe.num_experts) > 1:
        out = routed_experts_ep(h_nd, weights, run_ids, lp, mesh, moe)
    elif use_dense_experts(h_nd.shape[0], mesh):
        out = local_experts(h_nd, weights, run_ids, lp["we_gate"], lp["we_up"], lp["we_down"],
                            impl=kernel_impl(mesh, lp["we_gate"])).astype(h_nd.dtype)
    elif use_blocked_experts(h_nd.shape[0], mesh, lp["we_gate"]):
        out = blocked_experts(h_nd, weights, run_ids, lp["we_gate"], lp["we_up"], lp["we_down"],
                              impl=kernel_impl(mesh, lp["we_gate"])).astype(h_nd.dtype)
    else:
        out = routed_experts(h_nd, weights, run_ids, lp)
    if moe.shared_intermediate_size:
        shared = (jax.nn.silu(h_nd @ lp["ws_gate"]) * (h_nd @ lp["ws_up"])) @ lp["ws_down"]
        if moe.shared_gate:
            gate = jax.nn.sigmoid(jnp.dot(h_nd.astype(jnp.float32),
                                          lp["ws_router"].astype(jnp.float32)))
            shared = (gate * shared.astype(jnp.float32)).astype(h_nd.dtype)
        out = out + shared
    return out, ids
