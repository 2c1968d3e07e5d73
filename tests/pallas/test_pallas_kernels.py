"""TPU (simulator) and GPU (interpret=True) kernels vs the jnp reference; KV writes; shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from seer_jax.errors import InputError
from seer_jax.pallas import ragged_paged_attention, write_kv
from seer_jax.pallas.sharded import sharded_ragged_paged_attention, sharded_write_kv
from seer_jax.pallas.testing import make_batch

MIXED = [(1, 1328), (5, 18), (129, 463), (1, 17), (9, 64)]
TREE = [-1, 0, 0, 1, 2, 2, 4, -1, 7]  # two roots, branches; 9 verify tokens


def _call(b, impl, **kw):
    args = [jnp.asarray(a) for a in b.args()]
    tp = None if b.tree_parents is None else jnp.asarray(b.tree_parents)
    return np.asarray(ragged_paged_attention(*args, tree_parents=tp, impl=impl, **kw)
                      ).astype(np.float32)


def _check(b, impl, tol, **kw):
    ref = _call(b, "reference")
    out = _call(b, impl, interpret=True, **kw)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=tol, rtol=0)
    live = int(b.cu_q_lens[int(b.num_seqs)])
    assert np.all(out[live:] == 0)


@pytest.mark.parametrize(
    "seqs,page_size,hq,hkv,d,trees,splits",
    [
        (MIXED, 16, 9, 3, 64, {4: TREE}, None),  # SmolLM2 heads, mixed batch + tree
        (MIXED, 32, 4, 4, 128, None, 1),  # GQA 1, head_dim 128, page 32
        (MIXED, 16, 8, 2, 128, {1: [-1, 0, 0, 1, 1]}, 2),  # GQA 4
        ([(1, 70), (1, 33), (1, 5), (1, 128)], 32, 6, 2, 64, None, 4),  # decode, split-K
        ([(37, 37), (64, 80)], 16, 3, 1, 64, None, None),  # prefill only, GQA 3
    ],
)
@pytest.mark.slow
def test_gpu_kernel_matches_reference(seqs, page_size, hq, hkv, d, trees, splits):
    n_tok = sum(q for q, _ in seqs) + 5
    b = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                   max_seqs=len(seqs) + 2, num_tokens=n_tok, trees=trees, seed=len(seqs))
    _check(b, "gpu", 2e-5, num_kv_splits=splits)


@pytest.mark.slow
def test_gpu_kernel_bf16():
    b = make_batch([(1, 300), (9, 40), (20, 20)], num_q_heads=8, num_kv_heads=2, head_dim=64,
                   page_size=16, max_seqs=4, dtype=jnp.bfloat16, trees={1: TREE})
    _check(b, "gpu", 2e-2)


@pytest.mark.parametrize(
    "seqs,page_size,hq,hkv,trees",
    [
        ([(1, 40), (5, 18), (9, 30)], 16, 6, 2, {2: TREE}),  # decode + verify tree + chain
        ([(3, 70), (1, 9)], 32, 4, 4, None),  # GQA 1, page 32, several KV blocks
    ],
)
@pytest.mark.slow
def test_tpu_kernel_matches_reference_in_simulator(seqs, page_size, hq, hkv, trees):
    b = make_batch(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=64, page_size=page_size,
                   max_seqs=len(seqs) + 1, num_tokens=sum(q for q, _ in seqs) + 3, trees=trees)
    _check(b, "tpu", 2e-5, block_q=4, pages_per_block=1)


@pytest.mark.slow
def test_tree_beyond_kernel_window_is_nan_not_wrong():
    # Two roots; nodes 2..37 chain below node 1, so node 33+ has node 1 (an ancestor that is not
    # on the leading chain) more than 31 tokens back: the kernels cannot encode it.
    par = [-1, -1] + list(range(1, 37))
    b = make_batch([(38, 40)], num_q_heads=2, num_kv_heads=1, head_dim=16, page_size=16,
                   trees={0: par})
    out = _call(b, "gpu", interpret=True, pages_per_block=4)
    ref = _call(b, "reference")
    assert np.isnan(out[33:]).all() and np.isfinite(ref).all()
    np.testing.assert_allclose(out[:33], ref[:33], atol=2e-5, rtol=0)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_kernels_reject_unsupported_head_dim(impl):
    b = make_batch([(2, 20)], num_q_heads=2, num_kv_heads=1, head_dim=80, page_size=16)
    with pytest.raises(InputError, match="head_dim"):
        _call(b, impl, interpret=True)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
@pytest.mark.parametrize("hkv,page_size,layered", [(3, 16, False), (1, 8, True), (2, 32, True)])
def test_write_kv_kernels_match_reference(impl, hkv, page_size, layered):
    rng = np.random.default_rng(3)
    shape = (6, page_size, 2 * hkv, 64)
    if layered:
        shape = (3,) + shape
    kv = jnp.asarray(rng.normal(size=shape), jnp.float32)
    nk = jnp.asarray(rng.normal(size=(5, hkv, 64)), jnp.float32)
    nv = jnp.asarray(rng.normal(size=(5, hkv, 64)), jnp.float32)
    slots = jnp.array([3, -1, page_size + 1, 6 * page_size - 1, 2 * page_size + 5], jnp.int32)
    layer = {"layer": jnp.int32(1)} if layered else {}
    want = write_kv(kv, nk, nv, slots, impl="reference", **layer)
    fn = jax.jit(lambda *a: write_kv(*a, impl=impl, interpret=True, **layer), donate_argnums=0)
    got = fn(jnp.array(kv), nk, nv, slots)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the token rows landed where the slots say, K at 2h and V at 2h + 1, nothing else moved
    w = np.asarray(want)[1] if layered else np.asarray(want)
    np.testing.assert_array_equal(w[0, 3, 0::2], np.asarray(nk[0]))
    np.testing.assert_array_equal(w[1, 1, 1::2], np.asarray(nv[2]))
    untouched = np.asarray(kv)[1] if layered else np.asarray(kv)
    np.testing.assert_array_equal(w[3:5], untouched[3:5])  # pages no slot points into
    if layered:  # other layers are not written
        np.testing.assert_array_equal(np.asarray(want)[0], np.asarray(kv)[0])


@pytest.mark.slow
def test_tpu_kernel_bf16_many_kv_heads_in_simulator():
    b = make_batch([(1, 45), (4, 20)], num_q_heads=8, num_kv_heads=4, head_dim=128,
                   page_size=16, max_seqs=3, dtype=jnp.bfloat16, trees={1: [-1, 0, 0, 1]})
    _check(b, "tpu", 2e-2, block_q=8, pages_per_block=2)


@pytest.mark.parametrize("tp,hkv,impl", [(2, 2, "reference"), (4, 2, "reference"),
                                         (4, 4, "gpu"), (2, 1, "gpu")])
@pytest.mark.slow
def test_sharded_wrapper_equals_unsharded(tp, hkv, impl):
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    b = make_batch([(1, 50), (6, 30), (3, 3)], num_q_heads=8, num_kv_heads=hkv, head_dim=64,
                   page_size=16, max_seqs=4, num_tokens=12, trees={1: [-1, 0, 0, 1, 2, 2]})
    args = [jnp.asarray(a) for a in b.args()]
    tree = jnp.asarray(b.tree_parents)
    want = ragged_paged_attention(*args, tree_parents=tree, impl="reference")
    got = jax.jit(lambda *a: sharded_ragged_paged_attention(
        mesh, *a, tree_parents=tree, impl=impl, interpret=True))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_sharded_write_kv_equals_unsharded():
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    kv = jnp.zeros((3, 8, 8, 16))
    new = jnp.arange(3 * 4 * 16, dtype=jnp.float32).reshape(3, 4, 16)
    slots = jnp.array([1, 9, -1], jnp.int32)
    got = sharded_write_kv(mesh, kv, new, -new, slots, impl="reference")
    want = write_kv(kv, new, -new, slots, impl="reference")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    layered = sharded_write_kv(mesh, jnp.stack([kv, kv]), new, -new, slots, impl="reference",
                               layer=1)
    np.testing.assert_array_equal(np.asarray(layered[1]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(layered[0]), np.asarray(kv))


@pytest.mark.parametrize("sub_blocks", [2, 3])
@pytest.mark.slow
def test_tpu_kernel_sub_blocks_share_kv_fetches(sub_blocks):
    """q blocks of several sub-blocks (each K/V block fetched once for all of them) give the
    rows exactly what one sub-block per q block gives: a sub-block skips only K/V blocks its
    rows cannot see. Prefill chunks across sub-block and q block edges, decodes, a tree."""
    seqs = [(1, 40), (11, 30), (1, 9), (6, 26), (9, 50)]
    b = make_batch(seqs, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                   max_seqs=len(seqs) + 1, num_tokens=sum(q for q, _ in seqs) + 5,
                   trees={4: TREE}, seed=5)
    one = _call(b, "tpu", interpret=True, block_q=4, pages_per_block=1, sub_blocks=1)
    many = _call(b, "tpu", interpret=True, block_q=4, pages_per_block=1, sub_blocks=sub_blocks)
    np.testing.assert_array_equal(many, one)
    np.testing.assert_allclose(many, _call(b, "reference"), atol=2e-5, rtol=0)


def test_tpu_q_sub_blocks():
    from seer_jax.pallas.limits import TPU_MAX_Q_SUB_BLOCKS, tpu_q_sub_blocks

    kw = dict(block_q=16, rows_per_token=8, num_kv_heads=4, head_dim=128, q_bytes=2)
    assert tpu_q_sub_blocks(num_tokens=8, **kw) == 1  # a decode batch inside one sub-block
    assert tpu_q_sub_blocks(num_tokens=40, **kw) == 3
    assert tpu_q_sub_blocks(num_tokens=2048, **kw) == TPU_MAX_Q_SUB_BLOCKS
    # wide heads and many KV heads: fewer sub-blocks, within the VMEM bound
    assert tpu_q_sub_blocks(num_tokens=2048, **dict(kw, num_kv_heads=16, head_dim=256)) == 1
    assert tpu_q_sub_blocks(num_tokens=2048, **kw, requested=2) == 2
