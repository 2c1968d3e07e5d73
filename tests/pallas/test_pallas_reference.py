"""The jnp references: ragged paged attention vs naive dense attention, KV writes, input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from seer_jax.errors import InputError
from seer_jax.pallas import ragged_paged_attention, write_kv
from seer_jax.pallas.kv_layout import split_kv
from seer_jax.pallas.testing import make_batch, naive_attention
from seer_jax.pallas.tree import kernel_tree_mask

MIXED = [(1, 1328), (5, 18), (129, 463), (1, 17), (9, 64)]


def _run(b, **kw):
    args = [jnp.asarray(a) for a in b.args()]
    tp = None if b.tree_parents is None else jnp.asarray(b.tree_parents)
    return np.asarray(ragged_paged_attention(*args, tree_parents=tp, impl="reference", **kw))


@pytest.mark.parametrize("page_size,hq,hkv,d", [(16, 9, 3, 64), (32, 4, 4, 128), (16, 8, 2, 64)])
def test_mixed_batch_matches_naive(page_size, hq, hkv, d):
    b = make_batch(MIXED, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size,
                   max_seqs=7, num_tokens=152)
    out = _run(b)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, naive_attention(b), atol=2e-5, rtol=0)
    assert np.all(out[int(b.cu_q_lens[5]):] == 0)


def test_jit_with_max_q_len_and_traced_num_seqs():
    b = make_batch([(1, 40), (3, 20), (2, 2)], num_q_heads=4, num_kv_heads=2, head_dim=64,
                   page_size=16, max_seqs=5, num_tokens=8)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, impl="reference", max_q_len=3))
    out = np.asarray(fn(*[jnp.asarray(a) for a in b.args()]))
    np.testing.assert_allclose(out, naive_attention(b), atol=2e-5, rtol=0)


def test_tree_mask_matches_naive_and_chain_equals_causal():
    trees = {1: [-1, 0, 0, 1, 2, 2, -1], 2: [-1, 0, 1, 2]}
    b = make_batch([(1, 30), (7, 25), (4, 40)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                   page_size=16, trees=trees, num_tokens=14, max_seqs=4)
    np.testing.assert_allclose(_run(b), naive_attention(b), atol=2e-5, rtol=0)
    chain = make_batch([(1, 30), (7, 25), (4, 40)], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16, trees={2: [-1, 0, 1, 2]}, num_tokens=14, max_seqs=4)
    causal = _run(chain)
    chain.tree_parents = None
    np.testing.assert_allclose(causal, _run(chain), atol=1e-6, rtol=0)


def test_bf16_close_to_f32():
    b = make_batch([(3, 50), (1, 9)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16)
    ref = naive_attention(b)
    b16 = make_batch([(3, 50), (1, 9)], num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                     dtype=jnp.bfloat16)
    out = _run(b16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-2 * 3, rtol=0)


def test_kernel_tree_mask_encoding():
    # Sequence 0 is a chain of 3, sequence 1 a branching tree of 5.
    par = np.array([-1, 0, 1, -1, 0, 0, 1, 2], np.int32)
    cu = np.array([0, 3, 8, 8], np.int32)
    vis, bits, exact = (np.asarray(x) for x in kernel_tree_mask(
        jnp.asarray(par), jnp.asarray(cu), jnp.int32(2), 8))
    assert vis.tolist() == [1, 2, 3, 1, 2, 1, 2, 1]
    assert bits.tolist() == [1, 3, 7, 1, 3, 5, 13, 21]
    assert exact.all()


def test_write_kv_reference_writes_slots_and_skips_padding():
    kv = jnp.zeros((4, 4, 4, 8)).at[..., 1::2, :].set(1.0)  # K 0, V 1
    new_k = jnp.arange(3 * 2 * 8, dtype=jnp.float32).reshape(3, 2, 8) + 1
    new_v = -new_k
    slots = jnp.array([5, -1, 14], jnp.int32)
    fn = jax.jit(lambda kv, a, b, s: write_kv(kv, a, b, s, impl="reference"), donate_argnums=0)
    out = fn(jnp.array(kv), new_k, new_v, slots)
    k2, v2 = (np.asarray(x) for x in split_kv(out))  # [P, S, Hkv, D]
    np.testing.assert_array_equal(k2[1, 1], np.asarray(new_k[0]))
    np.testing.assert_array_equal(v2[3, 2], np.asarray(new_v[2]))
    assert np.count_nonzero(k2) == np.count_nonzero(np.asarray(new_k)[[0, 2]])
    assert (v2 == 1).sum() == v2.size - 2 * 2 * 8
    # a layer index writes that layer of a [L, P, S, 2 * Hkv, D] cache only
    both = write_kv(jnp.stack([kv, kv]), new_k, new_v, slots, impl="reference", layer=1)
    np.testing.assert_array_equal(np.asarray(both[1]), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(both[0]), np.asarray(kv))
    with pytest.raises(InputError, match="2 \\* num_kv_heads"):
        write_kv(jnp.zeros((4, 4, 3, 8)), new_k, new_v, slots, impl="reference")


def test_bad_inputs_raise_input_error():
    b = make_batch([(2, 20)], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    args = [jnp.asarray(a) for a in b.args()]
    with pytest.raises(InputError, match="multiple of num_kv_heads"):
        ragged_paged_attention(args[0][:, :3], *args[1:], impl="reference")
    with pytest.raises(InputError, match="page table"):
        ragged_paged_attention(*args[:2], jnp.array([40], jnp.int32), *args[3:], impl="reference")
    with pytest.raises(InputError, match="head_dim"):
        ragged_paged_attention(args[0][..., :32], *args[1:], impl="reference")
    with pytest.raises(InputError, match="impl"):
        ragged_paged_attention(*args, impl="cuda")
    # Under jit the lengths are traced: an overlong sequence yields NaN, never a quiet answer.
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, impl="reference"))
    out = np.asarray(fn(*args[:2], jnp.array([40], jnp.int32), *args[3:]))
    assert np.isnan(out).all()


@st.composite
def _ragged_case(draw):
    n = draw(st.integers(1, 4))
    seqs, trees = [], {}
    for i in range(n):
        ql = draw(st.integers(0 if i else 1, 10))
        seqs.append((ql, ql + draw(st.integers(0, 60))))
        if ql and draw(st.booleans()):
            trees[i] = [draw(st.integers(-1, j - 1)) for j in range(ql)]
    return dict(
        seqs=seqs, trees=trees or None,
        page_size=draw(st.sampled_from([4, 8, 16])),
        hkv=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 3])),
        extra_seqs=draw(st.integers(0, 2)), extra_tokens=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 1000)),
    )


_JIT_REF = jax.jit(lambda *a, tree: ragged_paged_attention(*a, tree_parents=tree,
                                                            impl="reference"))


@settings(max_examples=30, deadline=None)
@given(_ragged_case())
@example({"seqs": [(1, 1), (0, 0), (2, 2), (0, 1)], "trees": {2: [-1, 0]}, "page_size": 4,
          "hkv": 1, "group": 1, "extra_seqs": 0, "extra_tokens": 0, "seed": 0})
def test_property_reference_equals_naive_dense(case):
    # Fixed padded shapes per (page_size, heads) so the jitted reference compiles a few times.
    # sequences without keys are dropped; the trees follow their sequences' new places
    kept = [i for i, s in enumerate(case["seqs"]) if s[1] > 0]
    seqs = [case["seqs"][i] for i in kept] or [(1, 1)]
    trees = {j: case["trees"][i] for j, i in enumerate(kept) if i in (case["trees"] or {})}
    ps = case["page_size"]
    need = sum(-(-kv // ps) for _, kv in seqs)
    b = make_batch(seqs, num_q_heads=case["hkv"] * case["group"], num_kv_heads=case["hkv"],
                   head_dim=16, page_size=ps, max_seqs=6, num_tokens=44,
                   pages_per_seq=-(-70 // ps), extra_pages=4 * -(-70 // ps) + 1 - need,
                   trees=trees or {0: list(range(-1, seqs[0][0] - 1))},
                   seed=case["seed"])
    out = np.asarray(_JIT_REF(*[jnp.asarray(a) for a in b.args()],
                              tree=jnp.asarray(b.tree_parents)))
    np.testing.assert_allclose(out, naive_attention(b), atol=2e-5, rtol=0)
    assert np.all(out[int(b.cu_q_lens[len(seqs)]):] == 0)


@pytest.mark.parametrize("tree", [False, True])
def test_query_blocks_bound_the_scores_and_change_nothing(monkeypatch, tree):
    """A query region whose scores exceed SCORE_BLOCK_BYTES runs in blocks of query slots (one
    block's scores at a time, the block not dividing the slots): the output equals naive dense
    attention, causal and along draft trees."""
    from seer_jax.pallas import attention_ref

    trees = {1: [-1, 0, 0, 1, 2, 2, 3]} if tree else None
    b = make_batch([(1, 300), (7, 40), (45, 90)], num_q_heads=4, num_kv_heads=2, head_dim=32,
                   page_size=16, max_seqs=4, num_tokens=56, trees=trees)
    kv_cap = b.page_indices.shape[1] * 16
    per_slot = 4 * 4 * kv_cap * 4
    monkeypatch.setattr(attention_ref, "SCORE_BLOCK_BYTES", 6 * per_slot)
    assert attention_ref.query_block(4, 56, 4, kv_cap) == 4  # 14 blocks of 4 slots
    out = _run(b)
    assert np.isfinite(out[:int(b.cu_q_lens[3])]).all()
    np.testing.assert_allclose(out, naive_attention(b), atol=2e-5, rtol=0)
