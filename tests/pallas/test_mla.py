"""MLA (absorbed form) over the paged latent cache: the jnp reference vs naive attention, the TPU
(simulator) and GPU (interpret) kernels vs the reference, the latent writes, input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer_jax.errors import InputError
from seer_jax.pallas.mla import ragged_paged_mla_attention
from seer_jax.pallas.mla_layout import (
    latent_bytes_per_token,
    latent_cache_shape,
    padded_latent_bytes_per_token,
)
from seer_jax.pallas.mla_testing import make_mla_batch, naive_mla
from seer_jax.pallas.mla_write import write_latent

# decode, a verify tree, a prefill chunk and short chains in one batch, padded with NaN pages,
# a padding sequence and padding tokens
MIXED = [(1, 100), (5, 18), (20, 63), (1, 17), (9, 40)]
SMALL = [(1, 40), (9, 30), (6, 20)]
TREE = [-1, 0, 0, 1, 2, 2, 4, -1, 7]  # two roots, branches; 9 verify tokens
SCALE = 0.08


def _args(b):
    return [jnp.asarray(a) for a in b.args()]


def _tree(b):
    return None if b.tree_parents is None else jnp.asarray(b.tree_parents)


_JIT_REF = jax.jit(lambda *a, tree: ragged_paged_mla_attention(
    *a, sm_scale=SCALE, tree_parents=tree, impl="reference"))


def _ref(b):
    return np.asarray(_JIT_REF(*_args(b), tree=_tree(b))).astype(np.float32)


def _check_kernel(b, impl, tol, **kw):
    # eager: the interpreters run faster op by op than compiled whole on a small batch
    out = ragged_paged_mla_attention(*_args(b), sm_scale=SCALE, tree_parents=_tree(b),
                                     impl=impl, interpret=True, **kw)
    out = np.asarray(out).astype(np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _ref(b), atol=tol, rtol=0)
    assert np.all(out[int(b.cu_q_lens[int(b.num_seqs)]):] == 0)


def _mixed(dtype=np.float32, heads=4, rank=128, rope=64, page_size=16, **kw):
    return make_mla_batch(MIXED, num_heads=heads, kv_lora_rank=rank, rope_dim=rope,
                          page_size=page_size, max_seqs=7, num_tokens=40, trees={4: TREE},
                          dtype=dtype, **kw)


def _small(dtype=np.float32, heads=4, **kw):
    """A decode, a verify tree and a prefill chain, a padding sequence and padding tokens."""
    return make_mla_batch(SMALL, num_heads=heads, kv_lora_rank=128, rope_dim=64, page_size=16,
                          max_seqs=4, num_tokens=20, trees={1: TREE}, dtype=dtype, **kw)


def test_reference_matches_naive_mixed_batch_with_tree():
    b = _mixed(heads=3, rank=32, rope=16)
    out = _ref(b)
    np.testing.assert_allclose(out, naive_mla(b, SCALE), atol=1e-5, rtol=0)
    assert np.all(out[int(b.cu_q_lens[5]):] == 0)


@st.composite
def _ragged_case(draw):
    n = draw(st.integers(1, 4))
    seqs, trees = [], {}
    for i in range(n):
        ql = draw(st.integers(0 if i else 1, 8))
        seqs.append((ql, ql + draw(st.integers(0, 50))))
        if ql and draw(st.booleans()):
            trees[i] = [draw(st.integers(-1, j - 1)) for j in range(ql)]
    return dict(seqs=seqs, trees=trees, seed=draw(st.integers(0, 1000)))


@settings(max_examples=15, deadline=None)
@given(_ragged_case())
def test_property_reference_equals_naive(case):
    # fixed padded shapes, so the jitted reference compiles once
    seqs = [s for s in case["seqs"] if s[1] > 0] or [(1, 1)]
    need = sum(-(-kv // 8) for _, kv in seqs)
    b = make_mla_batch(seqs, num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=8, max_seqs=5,
                       num_tokens=36, pages_per_seq=8, extra_pages=33 - need,
                       trees=case["trees"] or {0: list(range(-1, seqs[0][0] - 1))},
                       seed=case["seed"])
    out = _ref(b)
    np.testing.assert_allclose(out, naive_mla(b, SCALE), atol=1e-5, rtol=0)
    assert np.all(out[int(b.cu_q_lens[len(seqs)]):] == 0)


def test_reference_bf16_close_to_f32():
    b = _mixed(heads=2, rank=32, rope=16)
    b16 = _mixed(np.dtype(jnp.bfloat16), heads=2, rank=32, rope=16)
    out = _ref(b16)
    np.testing.assert_allclose(out, naive_mla(b, SCALE), atol=2e-2 * 3, rtol=0)


@pytest.mark.slow
def test_tpu_kernel_matches_reference_in_simulator():
    # two q blocks, two-page K/V blocks (the double buffer alternates)
    _check_kernel(_small(), "tpu", 1e-5, block_q=16, pages_per_block=2)


@pytest.mark.slow
def test_gpu_kernel_matches_reference():
    # two head groups of 16, split-K over single pages
    _check_kernel(_small(heads=32), "gpu", 1e-5, num_kv_splits=2, pages_per_block=1)


@pytest.mark.slow
def test_gpu_kernel_bf16():
    _check_kernel(_small(np.dtype(jnp.bfloat16), heads=16), "gpu", 2e-2)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype,tol,kw", [
    (np.float32, 1e-5, dict(block_q=4, pages_per_block=2)),  # many q blocks, 2-page blocks
    (np.float32, 1e-5, dict(heads=16)),  # default tiling
    (jnp.bfloat16, 2e-2, dict(heads=8)),
])
def test_tpu_kernel_mixed_batches_in_simulator(dtype, tol, kw):
    shape = {"heads": kw.pop("heads")} if "heads" in kw else {}
    _check_kernel(_mixed(np.dtype(dtype), **shape), "tpu", tol, **kw)


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype,tol,kw", [
    (np.float32, 1e-5, dict(heads=4, num_kv_splits=1)),  # prefill blocks, pages gathered
    (np.float32, 1e-5, dict(heads=32, num_kv_splits=3)),  # head groups, split-K
    (np.float32, 1e-5, dict(heads=5, rank=256, page_size=64)),  # heads padded, page slices
    (jnp.bfloat16, 2e-2, dict(heads=64)),  # four head groups
])
def test_gpu_kernel_mixed_batches(dtype, tol, kw):
    shape = {k: kw.pop(k) for k in ("heads", "rank", "page_size") if k in kw}
    _check_kernel(_mixed(np.dtype(dtype), **shape), "gpu", tol, **kw)


@pytest.mark.parametrize("impl,dtype,layered", [
    ("tpu", jnp.bfloat16, True), ("gpu", jnp.bfloat16, True), ("gpu", jnp.float32, False),
    pytest.param("tpu", jnp.float32, False, marks=pytest.mark.exhaustive)])
def test_write_latent_kernels_match_reference(impl, dtype, layered):
    rng = np.random.default_rng(3)
    ps = 16
    shape = latent_cache_shape(3 if layered else None, 6, ps, 128, 64)
    cache = jnp.asarray(rng.normal(size=shape), dtype)
    # slots 3, 4, 5 share a tile inside one window; 2ps + 5 and 2ps + 6 too; one padding token
    slots = jnp.array([3, -1, ps + 1, 6 * ps - 1, 2 * ps + 5, 4, 5, 2 * ps + 6, 17, 40, 95],
                      jnp.int32)
    new_c = jnp.asarray(rng.normal(size=(11, 128)), dtype)
    new_r = jnp.asarray(rng.normal(size=(11, 64)), dtype)
    layer = {"layer": jnp.int32(1)} if layered else {}
    want = write_latent(cache, new_c, new_r, slots, impl="reference", **layer)
    fn = jax.jit(lambda *a: write_latent(*a, impl=impl, interpret=True, **layer),
                 donate_argnums=0)
    got = fn(jnp.array(cache), new_c, new_r, slots)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    w = np.asarray(want[1] if layered else want, np.float32)
    np.testing.assert_array_equal(w[0, 4], np.concatenate([new_c[5], new_r[5]]).astype(np.float32))
    before = np.asarray(cache[1] if layered else cache, np.float32)
    np.testing.assert_array_equal(w[3:5], before[3:5])  # pages no slot points into
    if layered:
        np.testing.assert_array_equal(np.asarray(want[0]), np.asarray(cache[0]))


def test_written_rows_are_what_attention_reads():
    """Rows written by write_latent at the slots of a page table give the same attention as a
    batch built with them in place."""
    b = make_mla_batch([(3, 20)], num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=8)
    pages = b.page_indices[0]
    slots = np.array([pages[i // 8] * 8 + i % 8 for i in range(17, 20)], np.int32)
    rows = b.latent_pages.reshape(-1, 24)[slots]
    cache = b.latent_pages.copy().reshape(-1, 24)
    cache[slots] = np.nan
    cache = write_latent(jnp.asarray(cache.reshape(b.latent_pages.shape)),
                         jnp.asarray(rows[:, :16]), jnp.asarray(rows[:, 16:]),
                         jnp.asarray(slots), impl="reference")
    b2 = make_mla_batch([(3, 20)], num_heads=2, kv_lora_rank=16, rope_dim=8, page_size=8)
    b2.latent_pages = np.asarray(cache)
    np.testing.assert_array_equal(_ref(b2), _ref(b))


def test_input_errors():
    b = _mixed(heads=2, rank=32, rope=16)
    args = _args(b)
    call = lambda *a, **kw: ragged_paged_mla_attention(*a, sm_scale=SCALE, **kw)
    with pytest.raises(InputError, match="q_rope"):
        call(args[0], args[1][:, :1], *args[2:], impl="reference")
    with pytest.raises(InputError, match="rows hold"):
        call(args[0], args[1][..., :8], *args[2:], impl="reference")
    with pytest.raises(InputError, match="dtypes"):
        call(args[0].astype(jnp.bfloat16), *args[1:], impl="reference")
    with pytest.raises(InputError, match="page table"):
        call(*args[:3], jnp.array([999] * 7, jnp.int32), *args[4:], impl="reference")
    with pytest.raises(InputError, match="layer"):
        call(*args, impl="reference", layer=0)
    with pytest.raises(InputError, match="kv_lora_rank"):
        call(*args, impl="tpu", interpret=True)  # 32 is not a multiple of 128
    b5 = _mixed(heads=2, rank=48, rope=16)
    with pytest.raises(InputError, match="power of two"):
        call(*_args(b5), impl="gpu", interpret=True)
    with pytest.raises(InputError, match="slot_mapping"):
        write_latent(args[2], args[0][:3, 0], args[1][:3, 0], jnp.zeros(2, jnp.int32))
    # under jit the lengths are traced: an overlong sequence gives NaN, never a quiet answer
    out = jax.jit(lambda *a: call(*a, impl="reference"))(
        *args[:3], jnp.asarray(b.kv_lens).at[0].set(999), *args[4:])
    assert np.isnan(np.asarray(out)[0]).all() and np.isfinite(np.asarray(out)[1:5]).all()


def test_latent_cache_bytes():
    # DeepSeek-V3 / Kimi-K2 / Moonlight: 512 + 64 values per token-layer, 640 lanes on a TPU
    assert latent_bytes_per_token(512, 64, 2) == 1152
    assert padded_latent_bytes_per_token(512, 64, 2) == 1280
    assert latent_cache_shape(61, 10, 16, 512, 64) == (61, 10, 16, 576)


@pytest.mark.parametrize("tp,impl", [(4, "gpu")])
def test_sharded_mla_equals_unsharded(tp, impl):
    from jax.sharding import Mesh

    from seer_jax.pallas.mla_sharded import sharded_mla_attention, sharded_write_latent

    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))
    b = make_mla_batch([(1, 30), (6, 20), (3, 3)], num_heads=8, kv_lora_rank=32, rope_dim=16,
                       page_size=8, max_seqs=4, num_tokens=12, trees={1: [-1, 0, 0, 1, 2, 2]})
    args = _args(b)
    cache = jnp.stack([args[2], args[2]])  # a two-layer cache, layer 1 read
    slots = jnp.array([0, -1, 9], jnp.int32)
    new_c, new_r = args[0][:3, 0], args[1][:3, 0]
    want_cache = write_latent(cache, new_c, new_r, slots, impl="reference", layer=1)
    got_cache = sharded_write_latent(mesh, cache, new_c, new_r, slots, impl=impl,
                                     interpret=True, layer=1)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    want = jax.jit(lambda *a: ragged_paged_mla_attention(
        *a, sm_scale=SCALE, tree_parents=_tree(b), impl="reference", layer=1))(
            args[0], args[1], want_cache, *args[3:])
    got = jax.jit(lambda *a: sharded_mla_attention(
        mesh, *a, sm_scale=SCALE, tree_parents=_tree(b), impl=impl, interpret=True,
        layer=1))(args[0], args[1], got_cache, *args[3:])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


@pytest.mark.exhaustive
def test_tree_beyond_kernel_window_is_nan_not_wrong():
    # nodes 2..37 chain below node 1 (node 0 a second root): from node 33 on, node 1 is an
    # ancestor more than 31 tokens back and off the leading chain, which the kernels' per-token
    # mask cannot encode; they return NaN for those tokens, never a wrong answer
    par = [-1, -1] + list(range(1, 37))
    b = make_mla_batch([(38, 40)], num_heads=2, kv_lora_rank=32, rope_dim=16, page_size=16,
                       trees={0: par})
    out = np.asarray(ragged_paged_mla_attention(*_args(b), sm_scale=SCALE, tree_parents=_tree(b),
                                                impl="gpu", interpret=True))
    ref = _ref(b)
    assert np.isnan(out[33:]).all() and np.isfinite(ref).all()
    np.testing.assert_allclose(out[:33], ref[:33], atol=1e-5, rtol=0)
