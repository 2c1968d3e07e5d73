"""The all-to-all expert dispatch: its emulated ragged all-to-all (XLA:CPU has none) follows the
collective's documented example, the dispatch equals the one-device experts at ep 2, 4 and 8
(with the ragged_dot and with the blocked grouped matmul over the rows each device receives),
and the choice between it and the psum follows the bytes each sends."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from seer_jax.model.config import tiny_config
from seer_jax.model.llama import init_params, split_layers
from seer_jax.model.moe import MOE_AXES, expert_dispatch, moe_mlp
from seer_jax.model.moe_config import MoeConfig
from seer_jax.model.moe_dispatch import dispatch_bytes, emulated_ragged_all_to_all
from seer_jax.model.sharding import make_mesh, shard_params


def test_emulated_ragged_all_to_all_follows_the_documented_example():
    """`jax.lax.ragged_all_to_all`'s docstring example (axis of size 2)."""
    args = {  # per device: operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
        0: ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),
        1: ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1])}
    stacked = [jnp.array([args[0][i], args[1][i]], jnp.int32) for i in range(6)]
    mesh = make_mesh(jax.devices()[:2])

    def f(*a):
        return emulated_ragged_all_to_all(*(x[0] for x in a), axis_name="tp")[None]

    out = jax.shard_map(f, mesh=mesh, in_specs=(P("tp"),) * 6, out_specs=P("tp"))(*stacked)
    assert np.asarray(out).tolist() == [[1, 3, 0, 0], [2, 2, 4, 0]]


def _layer(num_experts=8, k=2, seed=5):
    moe = MoeConfig(num_experts=num_experts, num_experts_per_tok=k, expert_intermediate_size=16,
                    norm_topk_prob=True)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_layers=1, moe=moe)
    lp = split_layers(init_params(cfg, seed=seed), cfg)["layers"][0]
    return moe, cfg, {key: v for key, v in lp.items() if key in MOE_AXES}


@pytest.mark.parametrize("tp, blocked", [(2, False), (4, True),
                                         pytest.param(4, False, marks=pytest.mark.exhaustive),
                                         pytest.param(8, True, marks=pytest.mark.exhaustive)])
def test_all_to_all_dispatch_equals_one_device(monkeypatch, tp, blocked):
    from seer_jax.model import grouped_matmul
    from seer_jax.model import moe as moe_module

    moe, cfg, lp = _layer()
    # 37 tokens: not a multiple of the devices (the last device's share padded)
    x = np.random.RandomState(1).randn(37, cfg.hidden_size).astype(np.float32)
    ref, ref_ids = moe_mlp(x, lp, moe)
    mesh = make_mesh(jax.devices()[:tp])
    sharded = shard_params({"layers": {key: v[None] for key, v in lp.items()}}, mesh)["layers"]
    sharded = {key: v[0] for key, v in sharded.items()}
    monkeypatch.setattr(moe_module, "expert_dispatch", lambda *a: "all_to_all")
    if blocked:
        real = grouped_matmul.blocked_experts
        monkeypatch.setattr(moe_module, "use_blocked_experts", lambda *a: True)
        monkeypatch.setattr(moe_module, "blocked_experts",
                            lambda *a, **k: real(*a, block=4, group=2))
    fn = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh))
    assert "all_to_all" in str(jax.make_jaxpr(fn)(x, sharded))
    out, ids = fn(x, sharded)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6, rtol=0)
    assert np.array_equal(np.asarray(ids), np.asarray(ref_ids))


def test_the_dispatch_follows_the_bytes_sent():
    moe = MoeConfig(num_experts=128, num_experts_per_tok=8, expert_intermediate_size=768,
                    norm_topk_prob=True)
    assert expert_dispatch(8192, None, moe, 4096, 2) == "local"
    got = {tp: expert_dispatch(8192, make_mesh(jax.devices()[:tp]), moe, 4096, 2)
           for tp in (2, 4, 8)}
    # top-8: a device's pairs are 8 / ep of the tokens' rows, in bf16 against float32 partials
    assert got == {2: "psum", 4: "psum", 8: "all_to_all"}
    sent = dispatch_bytes(8192, 4096, 8, 8, 2)
    assert sent["all_to_all"] < 0.8 * sent["psum"]
