"""The engine's MLA call picks the plan's kernel (per shard on a mesh) and equals the reference;
kernel shape problems are ConfigErrors at build time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from seer_jax.engine.attention_backend import AttentionPlan
from seer_jax.engine.mla_backend import check_mla_kernel_shapes, mla_attention, mla_impl, mla_write
from seer_jax.errors import ConfigError
from seer_jax.pallas.mla_testing import make_mla_batch


def _plan(impl, tp=1):
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",)) if tp > 1 else None
    return AttentionPlan(impl=impl, interpret=impl in ("tpu", "gpu"), mesh=mesh, tp=tp,
                         kv_repeat=1)


@pytest.mark.parametrize("impl,tp", [("cpu", 1), ("gpu", 2)])
def test_plan_call_equals_reference(impl, tp):
    b = make_mla_batch([(1, 20), (4, 9)], num_heads=4, kv_lora_rank=32, rope_dim=16,
                       page_size=8, max_seqs=3, num_tokens=6)
    ql, qr, cache, *rest = [jnp.asarray(a) for a in b.args()]
    cache = jnp.stack([cache, cache])
    slots = jnp.array([1, 2], jnp.int32)
    plan, ref = _plan(impl, tp), _plan("reference")
    got_cache = mla_write(plan, cache, ql[:2, 0], qr[:2, 0], slots, 0)
    want_cache = mla_write(ref, cache, ql[:2, 0], qr[:2, 0], slots, 0)
    np.testing.assert_array_equal(np.asarray(got_cache), np.asarray(want_cache))
    got = jax.jit(lambda *a: mla_attention(plan, *a, layer=0, sm_scale=0.1))(
        ql, qr, got_cache, *rest)
    want = jax.jit(lambda *a: mla_attention(ref, *a, layer=0, sm_scale=0.1, max_q_len=4))(
        ql, qr, want_cache, *rest)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    assert mla_impl(plan) == ("reference" if impl == "cpu" else impl)


def test_kernel_shape_problems_are_config_errors():
    shapes = dict(num_heads=16, kv_lora_rank=512, rope_dim=64, dtype_bytes=2, max_seqs=64,
                  pages_per_seq=256, max_tokens=512)
    check_mla_kernel_shapes(_plan("tpu"), page_size=16, **shapes)
    check_mla_kernel_shapes(_plan("gpu"), page_size=16, **shapes)
    with pytest.raises(ConfigError, match="page_size=8"):
        check_mla_kernel_shapes(_plan("tpu"), page_size=8, **shapes)
    with pytest.raises(ConfigError, match="power of two"):
        check_mla_kernel_shapes(_plan("gpu"), page_size=24, **shapes)
    check_mla_kernel_shapes(_plan("reference"), page_size=24, **shapes)
