"""The blocked grouped matmul GPUs run for prefill-sized expert batches equals the grouped
ragged_dot: alone (blocks of every size against the group sizes, experts split over devices) and
inside the MoE MLP, one device and expert-parallel."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from seer_jax.model.config import tiny_config
from seer_jax.model.grouped_matmul import block_layout, blocked_experts, num_blocks
from seer_jax.model.llama import init_params, split_layers
from seer_jax.model.moe import MOE_AXES, moe_mlp, routed_experts
from seer_jax.model.moe_config import MoeConfig
from seer_jax.model.sharding import make_mesh, shard_params


def _problem(N=37, k=3, E=8, d=16, f=12, skew=False):
    rs = np.random.RandomState(0)
    x = rs.randn(N, d).astype(np.float32)
    p = np.arange(1, E + 1, dtype=np.float64) ** (3 if skew else 0)
    ids = np.stack([rs.choice(E, k, replace=False, p=p / p.sum()) for _ in range(N)])
    w = rs.rand(N, k).astype(np.float32)
    lp = {"we_gate": rs.randn(E, d, f), "we_up": rs.randn(E, d, f), "we_down": rs.randn(E, f, d)}
    return x, w, ids.astype(np.int32), {n: v.astype(np.float32) for n, v in lp.items()}


def test_block_layout_gives_each_block_one_expert():
    _, _, ids, _ = _problem(skew=True)
    flat = ids.reshape(-1)
    R = num_blocks(flat.size, 4, 4, 2) * 4
    row_of_pair, pair_of_row, block_expert, used = map(
        np.asarray, block_layout(flat, 2, 4, R, 4))
    local = (flat >= 2) & (flat < 6)
    assert np.all(row_of_pair[~local] == R)
    # every local pair has a row, the row points back, and the row's block is the pair's expert
    rows = row_of_pair[local]
    assert len(set(rows.tolist())) == rows.size and np.all(pair_of_row[rows] == np.flatnonzero(local))
    assert np.all(block_expert[rows // 4] == flat[local] - 2)
    sizes = np.bincount(flat[local] - 2, minlength=4)
    assert used == sum(-(-s // 4) for s in sizes)
    assert np.all(pair_of_row[used * 4:] == flat.size)


@pytest.mark.parametrize("block, group", [(4, 2), (8, 3), pytest.param(1, 1, marks=pytest.mark.exhaustive),
                                          pytest.param(256, 8, marks=pytest.mark.exhaustive)])
def test_blocked_experts_equal_the_ragged_dot(block, group):
    x, w, ids, lp = _problem(skew=block == 4)
    ref = np.asarray(routed_experts(x, w, ids, lp))
    weights = lp["we_gate"], lp["we_up"], lp["we_down"]
    run = jax.jit(lambda first, *weights: blocked_experts(x, w, ids, *weights, first, block, group))
    np.testing.assert_allclose(np.asarray(run(0, *weights)), ref, atol=1e-4, rtol=1e-6)
    # the experts split over 4 devices: the parts sum to the whole
    parts = sum(np.asarray(run(s, *(a[s:s + 2] for a in weights))) for s in (0, 2, 4, 6))
    np.testing.assert_allclose(parts, ref, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("tp, impl", [(1, "xla"), (4, "xla"), (1, "interpret"),
                                      (4, "interpret")])
def test_moe_mlp_on_the_blocked_path_equals_the_ragged_dot(monkeypatch, tp, impl):
    """The MoE MLP on the blocked path (the loop of batched matmuls, and the GPU expert GEMM
    kernel in interpret mode at its default block rows), one device and expert-parallel, equals
    the ragged_dot's."""
    from seer_jax.model import grouped_matmul
    from seer_jax.model import moe as moe_module

    moe = MoeConfig(num_experts=8, num_experts_per_tok=2, expert_intermediate_size=16,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe)
    lp = split_layers(init_params(cfg, seed=5), cfg)["layers"][0]
    lp = {k: v for k, v in lp.items() if k in MOE_AXES}
    x = np.random.RandomState(1).randn(40, cfg.hidden_size).astype(np.float32)
    ref, ref_ids = moe_mlp(x, lp, moe)
    assert not moe_module.use_blocked_experts(40, None)  # the CPU keeps the ragged_dot
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    if mesh is not None:
        sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
        lp = {k: v[0] for k, v in sharded.items()}
    calls = []
    real = grouped_matmul.blocked_experts
    monkeypatch.setattr(moe_module, "use_blocked_experts", lambda *a: True)
    assert moe_module.blocked_impl(lp["we_gate"]) == "pallas"  # the kernel tiles these shapes
    monkeypatch.setattr(moe_module, "kernel_impl", lambda *a: impl)
    block = {"block": 4, "group": 2} if impl == "xla" else {}
    monkeypatch.setattr(moe_module, "blocked_experts",
                        lambda *a, **k: calls.append(k["impl"]) or real(*a, **k, **block))
    out, ids = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh))(x, lp)
    assert calls and set(calls) == {impl}
    assert calls
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


def test_expected_iterations_and_the_static_analysis_variant():
    """The loop iterations uniform routing fills match a Monte Carlo of the block layout, and
    the analysis variant unrolled to enough iterations gives the loop's outputs."""
    from seer_jax.model.grouped_matmul import expected_iterations, static_iterations

    rs = np.random.RandomState(1)
    N, k, E, block, group = 300, 2, 16, 8, 2
    used = []
    for _ in range(200):
        ids = np.stack([rs.choice(E, k, replace=False) for _ in range(N)]).reshape(-1)
        used.append(sum(-(-s // block) for s in np.bincount(ids, minlength=E)))
    mc = -(-np.mean(used) // 1)
    assert expected_iterations(N, k, E, E, block, group) == -(-int(mc) // group)
    assert expected_iterations(2048, 8, 128, 128) == 16  # a 2,048-token chunk at top-8 of 128
    x, w, ids, lp = _problem()
    weights = lp["we_gate"], lp["we_up"], lp["we_down"]
    ref = np.asarray(blocked_experts(x, w, ids, *weights, 0, 4, 2))
    need = -(-int(block_layout(ids.reshape(-1), 0, 8, num_blocks(ids.size, 8, 4, 2) * 4, 4)[3])
             // 2)
    with static_iterations(need):
        out = np.asarray(jax.jit(lambda *a: blocked_experts(x, w, ids, *a, 0, 4, 2))(*weights))
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-6)


# the kernels' smallest shapes: the GPU kernel's 16-wide tiles; the TPU kernel's 128 lanes (the
# tokens' hidden size packed two 16-bit halves to a 32-bit word: 256)
KERNEL_SHAPES = {"interpret": (32, 48), "tpu_interpret": (256, 128)}


@pytest.mark.parametrize("impl", ["interpret", "tpu_interpret"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expert_gemm_kernel_equals_the_ragged_dot(dtype, impl):
    """The expert GEMM kernels (GPU and TPU, Pallas interpret mode) over the block layout give
    the grouped ragged_dot's sums: one device, and the experts split over 4 devices (the parts
    sum to the whole); blocks of 16 rows (skewed routing: experts of several blocks and of none,
    and, split over 4, devices whose unused blocks outnumber the used)."""
    import jax.numpy as jnp

    d, f = KERNEL_SHAPES[impl]
    x, w, ids, lp = _problem(N=37, k=3, E=8, d=d, f=f, skew=True)
    ref = np.asarray(routed_experts(x, w, ids, lp))
    weights = tuple(jnp.asarray(lp[n], dtype) for n in ("we_gate", "we_up", "we_down"))
    xd = jnp.asarray(x, dtype)
    run = jax.jit(lambda first, *ws: blocked_experts(xd, w, ids, *ws, first, 16,
                                                     impl=impl, num_experts=8))
    tol = 1e-4 if dtype == "float32" else 0.02
    scale = np.abs(ref).max()
    np.testing.assert_allclose(np.asarray(run(0, *weights)) / scale, ref / scale, atol=tol)
    parts = sum(np.asarray(run(s, *(a[s:s + 2] for a in weights))) for s in (0, 2, 4, 6))
    np.testing.assert_allclose(parts / scale, ref / scale, atol=tol)


def _tpu_moe_layer(experts_dtype=np.float32):
    """A 16-expert top-2 Qwen3-MoE layer at the TPU kernel's smallest shapes: (moe config, its
    MoE params with the expert weights in `experts_dtype`, hidden size)."""
    d, f = KERNEL_SHAPES["tpu_interpret"]
    moe = MoeConfig(num_experts=16, num_experts_per_tok=2, expert_intermediate_size=f,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe,
                      hidden_size=d)
    lp = split_layers(init_params(cfg, seed=3), cfg)["layers"][0]
    lp = {k: np.asarray(v).astype(experts_dtype) if k.startswith("we_") else np.asarray(v)
          for k, v in lp.items() if k in MOE_AXES}
    return moe, lp, d


@pytest.mark.parametrize("path, tp", [("blocked", 1), ("blocked", 4), ("sparse", 1),
                                      ("sparse", 2)])
def test_moe_mlp_through_the_tpu_kernel_equals_the_ragged_dot(monkeypatch, path, tp):
    """The MoE MLP with a TPU's formulations, the TPU expert GEMM kernel in the TPU simulator:
    a prefill-sized batch on the blocked path and a decode batch hitting few experts
    (`sparse_experts`), on one device and expert-parallel, equal the ragged_dot's; the experts
    no token chose hold NaN weights, which the kernel never reads (an unused block keeps the
    last used expert's tiles)."""
    from seer_jax.model import moe as moe_module

    moe, lp, d = _tpu_moe_layer()
    x = np.random.RandomState(2).randn(12 if path == "blocked" else 2, d).astype(np.float32)
    ref, ref_ids = moe_mlp(x, lp, moe)
    unused = ~np.isin(np.arange(16), np.asarray(ref_ids))
    assert unused.any()
    lp = {k: np.where(unused[:, None, None], np.nan, v).astype(v.dtype) if k.startswith("we_")
          else v for k, v in lp.items()}
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    if mesh is not None:
        sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
        lp = {k: v[0] for k, v in sharded.items()}
    monkeypatch.setattr(moe_module, "_platform", lambda m: "tpu")  # a TPU's choices
    monkeypatch.setattr(moe_module, "kernel_impl", lambda *a: "tpu_interpret")
    assert moe_module.use_blocked_experts(12, None, lp["we_gate"])
    assert moe_module.use_dense_experts(2, None) and not moe_module.use_dense_experts(300, None)
    if path == "blocked":  # 12 tokens stand for a prefill chunk
        monkeypatch.setattr(moe_module, "use_dense_experts", lambda *a: False)
    calls = []
    for name in ("blocked_experts", "sparse_experts"):
        real = getattr(moe_module, name)
        monkeypatch.setattr(moe_module, name, lambda *a, real=real, name=name, **k:
                            calls.append(name) or real(*a, **k))
    out, ids = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh))(x, lp)
    assert set(calls) == {f"{path}_experts"}
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


def test_tpu_kernel_behind_the_all_to_all_takes_packed_rows(monkeypatch):
    """Expert-parallel over 2 devices with the all-to-all dispatch and the TPU kernel (TPU
    simulator), in bfloat16: the tokens are packed once before the exchange (the kernel packs
    nothing on arrival) and the MLP equals the ragged_dot's to bfloat16 rounding."""
    import jax.numpy as jnp

    from seer_jax.model import moe as moe_module
    from seer_jax.pallas import expert_gemm_tpu

    moe, lp, d = _tpu_moe_layer(jnp.bfloat16)
    x = jnp.asarray(np.random.RandomState(2).randn(12, d), jnp.bfloat16)
    ref, ref_ids = moe_mlp(x, lp, moe)
    mesh = make_mesh(jax.devices()[:2])
    sharded = shard_params({"layers": {k: v[None] for k, v in lp.items()}}, mesh)["layers"]
    sharded = {k: v[0] for k, v in sharded.items()}
    monkeypatch.setattr(moe_module, "use_dense_experts", lambda *a: False)
    monkeypatch.setattr(moe_module, "use_blocked_experts", lambda *a: True)
    monkeypatch.setattr(moe_module, "kernel_impl", lambda *a: "tpu_interpret")
    monkeypatch.setattr(moe_module, "expert_dispatch", lambda *a: "all_to_all")
    packs = []
    real = expert_gemm_tpu.pack_rows
    monkeypatch.setattr(expert_gemm_tpu, "pack_rows", lambda a: packs.append(a.shape) or real(a))
    out, ids = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh))(x, sharded)
    assert packs == [(12, d)]  # once, the tokens before the exchange
    assert out.dtype == jnp.bfloat16
    scale = float(np.abs(np.asarray(ref, np.float32)).max())
    np.testing.assert_allclose(np.asarray(out, np.float32) / scale,
                               np.asarray(ref, np.float32) / scale, atol=0.02)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


def test_expert_gemm_shapes_it_cannot_tile_are_refused():
    """A hidden size with no power-of-two tile of at least 16 keeps the loop of batched matmuls
    on a GPU (`blocked_impl`), and the kernel itself refuses it naming the dimension; likewise
    for the TPU kernel's 128-lane tiles."""
    import jax.numpy as jnp

    from seer_jax.errors import InputError
    from seer_jax.model.moe import blocked_impl
    from seer_jax.pallas.expert_gemm_gpu import block_rows_for, expert_swiglu_gpu

    assert blocked_impl(np.zeros((4, 24, 32), np.float32)) == "xla"
    assert blocked_impl(np.zeros((4, 2048, 768), np.float32)) == "pallas"
    with pytest.raises(InputError, match="hidden_size=24"):
        expert_swiglu_gpu(jnp.zeros((8, 24)), jnp.zeros((32,), jnp.int32),
                          jnp.zeros((2,), jnp.int32), 1,
                          jnp.zeros((4, 24, 32)), jnp.zeros((4, 24, 32)), jnp.zeros((4, 32, 24)),
                          block_rows=16, interpret=True)
    # the TPU kernel: 128-lane tiles, the tokens' hidden size packed two to a 32-bit word; a TPU
    # that cannot tile the shapes keeps the ragged_dot
    from seer_jax.pallas.expert_gemm_tpu import expert_swiglu_tpu

    assert blocked_impl(np.zeros((4, 2048, 768), np.float32), "tpu") == "tpu"
    assert blocked_impl(np.zeros((4, 384, 768), np.float32), "tpu") == "xla"
    with pytest.raises(InputError, match="expert intermediate size=96"):
        expert_swiglu_tpu(jnp.zeros((8, 256)), jnp.zeros((32,), jnp.int32),
                          jnp.zeros((2,), jnp.int32), 1,
                          jnp.zeros((4, 256, 96)), jnp.zeros((4, 256, 96)), jnp.zeros((4, 96, 256)),
                          block_rows=16, interpret=True)
    # the TPU kernel's block rows: multiples of 16 at the mean plus four deviations (176 at a
    # 2,048-token chunk's 128 rows an expert), 512 at most; float16 tokens are refused (the row
    # packing is bfloat16's)
    from seer_jax.pallas import expert_gemm_tpu

    assert [expert_gemm_tpu.block_rows_for(m) for m in (0.5, 8, 128, 512)] == [16, 32, 176, 512]
    with pytest.raises(InputError, match="float16"):
        expert_swiglu_tpu(jnp.zeros((8, 256), jnp.float16), jnp.zeros((32,), jnp.int32),
                          jnp.zeros((2,), jnp.int32), 1, jnp.zeros((4, 256, 128)),
                          jnp.zeros((4, 256, 128)), jnp.zeros((4, 128, 256)), block_rows=16,
                          interpret=True)
    # block rows: 64 for a small batch, one block for most experts at a 2,048-token chunk
    # (128 pairs an expert on average), 256 at most
    assert [block_rows_for(m) for m in (2, 40, 128, 512)] == [64, 64, 256, 256]


def test_expected_blocks_match_a_monte_carlo():
    from seer_jax.model.grouped_matmul import expected_blocks

    rs = np.random.RandomState(2)
    N, k, E, block = 200, 2, 16, 16
    used = [sum(-(-s // block) for s in np.bincount(
        np.stack([rs.choice(E, k, replace=False) for _ in range(N)]).reshape(-1), minlength=E))
        for _ in range(200)]
    assert abs(expected_blocks(N, k, E, E, block) - np.mean(used)) < 0.02 * np.mean(used)
