"""Tunix adapter: SeerRollout inside a Tunix RLCluster / GRPOLearner on fake CPU devices."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.errors import ConfigError
from seer_jax.integrations.engine_group import detect_groups, slice_meshes
from seer_jax.integrations.nnx_actor import TunixLlama, masked_forward
from seer_jax.integrations.weight_sync import params_on, reshard_array, state_to_params
from seer_jax.model.config import tiny_config
from seer_jax.model.generate import full_forward, generate
from seer_jax.rollout.core.types import SamplingParams
from tests.integrations.tunix_tiny import flat_np, grpo_cluster, grpo_step

pytestmark = pytest.mark.slow  # engines or a cluster: make test runs these, test-fast does not

CFG = tiny_config(vocab_size=128, eos_token_ids=(2,))
PROMPTS = ["12+34=", "7*8=", "99-5="]
G = 4




def test_detect_groups_runs():
    assert detect_groups([[1], [1], [2], [2], [2], [1]]) == [(0, 2), (2, 3), (5, 1)]
    assert detect_groups([]) == []


def test_slice_meshes_checks_device_count():
    meshes = slice_meshes(jax.devices(), 2, 4)
    assert [m.devices.size for m in meshes] == [4, 4]
    assert not set(meshes[0].devices.flat) & set(meshes[1].devices.flat)
    with pytest.raises(ConfigError, match="num_instances=3 x tp=4"):
        slice_meshes(jax.devices(), 3, 4)


def test_actor_forward_matches_reference_and_respects_padding():
    from flax import nnx

    actor = TunixLlama(CFG, rngs=nnx.Rngs(params=0))
    toks = jnp.asarray(np.random.RandomState(0).randint(3, 128, (2, 7)), jnp.int32)
    logits, cache = actor(toks)
    assert cache is None
    np.testing.assert_allclose(logits, full_forward(actor.params(), CFG, toks), atol=1e-5)
    # Left padding with masked pads and shifted positions gives the same logits for real tokens.
    padded = jnp.concatenate([jnp.zeros((2, 3), jnp.int32), toks], axis=1)
    valid = padded != 0
    pos = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    mask = valid[:, None, :] & jnp.tril(jnp.ones((10, 10), bool))[None]
    out = masked_forward(actor.params(), CFG, padded, pos, mask)
    np.testing.assert_allclose(out[:, 3:], logits, atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_reshard_under_transfer_guard_copies_without_host():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    full = Mesh(np.array(jax.devices()), ("tp",))
    x = jax.jit(lambda: jnp.arange(64.0).reshape(8, 8), out_shardings=NamedSharding(full, P()))()
    sub = Mesh(np.array(jax.devices()[4:6]), ("tp",))
    with jax.transfer_guard_device_to_host("disallow_explicit"), \
            jax.transfer_guard_host_to_device("disallow_explicit"):
        y = reshard_array(x, NamedSharding(sub, P(None, "tp")), jnp.bfloat16)
        z = reshard_array(y, NamedSharding(full, P("tp")), jnp.float32)
    assert y.sharding.spec == P(None, "tp") and y.dtype == jnp.bfloat16
    assert {d.id for d in y.devices()} == {4, 5}
    np.testing.assert_array_equal(np.asarray(z), np.arange(64.0).reshape(8, 8))
    assert all(a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()
               for a in x.addressable_shards for b in z.addressable_shards if a.device == b.device)


def test_state_to_params_names_the_mismatch():
    from flax import nnx

    actor = TunixLlama(CFG, rngs=nnx.Rngs(params=0))
    other = tiny_config(vocab_size=128, num_layers=3)
    with pytest.raises(ConfigError, match=r"layers/attn_norm.*\(2, 64\).*\(3, 64\)"):
        state_to_params(nnx.state(actor, nnx.Param), other)
    with pytest.raises(ConfigError, match="missing"):
        state_to_params({"embed": actor.params()["embed"]}, CFG)


def _group(backend, params=None, **kw):
    from seer_jax.integrations.engine_group import EngineGroup
    from seer_jax.model.llama import init_params

    return EngineGroup(CFG, params or init_params(CFG, 0), slice_meshes(jax.devices()[:4], 2, 2),
                       EngineConfig(num_pages=64, page_size=8, max_num_seqs=16,
                                    max_num_batched_tokens=64, max_model_len=64),
                       eos_ids=(2,), backend=backend, **kw)


IDS = [[1, 49, 50, 43, 51, 52, 61], [1, 55, 42, 56, 61], [1, 57, 57, 45, 53, 61]]


def test_engine_group_backends_agree_and_sync_drops_stale_prefix_kv():
    from seer_jax.model.llama import init_params

    sp = SamplingParams(temperature=1.0)
    direct = _group("engine")
    a = direct.generate_groups(IDS, [3, 3, 3], sp, 12, seed=5)
    assert direct.last_backend == "engine" and len({r.instance for r in a}) == 2
    api = _group("api", controller_config={"chunk_size": 4})
    b = api.generate_groups(IDS, [3, 3, 3], sp, 12, seed=5)
    assert api.last_backend == "api"
    assert [(r.group_index, r.sample_index) for r in a] == [(r.group_index, r.sample_index) for r in b]
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
    assert len({tuple(r.token_ids) for r in a[:3]}) > 1  # samples of a group differ
    # weight sync: new version on every response, and the prompts' cached KV is not reused
    new = init_params(CFG, 1)
    greedy = SamplingParams(temperature=0.0)
    for group in (direct, api):
        group.generate_groups(IDS, [2, 2, 2], greedy, 8)
        assert group.update_params(new) == 1
        out = group.generate_groups(IDS, [2, 2, 2], greedy, 8)
        want = generate(new, CFG, IDS, 8, greedy, eos_ids=(2,))
        assert all(r.policy_version == 1 for r in out)
        assert [r.token_ids for r in out] == [w.token_ids for w in want for _ in range(2)]


def test_engine_group_refuses_sync_mid_rollout():
    from seer_jax.errors import SeerError

    group = _group("engine")
    group.engines[0].add_request("x", IDS[0], 4, SamplingParams())
    with pytest.raises(SeerError, match="during a rollout"):
        group.update_params(group.params(0))


tunix = pytest.importorskip("tunix")


def test_rollout_takes_parallelism_and_dtype_from_rollout_config():
    from flax import nnx
    from tunix.rl import utils as rl_utils
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from seer_jax.integrations.tunix import CharTokenizer, SeerRollout

    actor = TunixLlama(CFG, rngs=nnx.Rngs(params=0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    rc = RolloutConfig(tensor_parallel_size=4, data_parallel_size=2, data_type=jnp.bfloat16)
    ro = SeerRollout(actor, CharTokenizer(), mesh, rc, engine_config=EngineConfig(num_pages=8))
    assert [m.devices.size for m in ro.group.meshes] == [4, 4]
    assert ro.cfg.dtype == "bfloat16"
    assert all(v.dtype == jnp.bfloat16 for v in jax.tree.leaves(ro.group.params(1)))
    assert not rl_utils.is_sharing_weights(actor, ro.model())  # so Tunix does sync
    assert (ro.pad_id(), ro.eos_id(), ro.policy_version) == (0, 2, 0)
    with pytest.raises(ConfigError, match="data_type='int8'"):
        SeerRollout(actor, CharTokenizer(), mesh, RolloutConfig(data_type=jnp.int8))


@pytest.fixture(scope="module")
def cluster():
    from flax import nnx

    actor = TunixLlama(CFG, rngs=nnx.Rngs(params=0))
    return grpo_cluster(actor, (2, 4), EngineConfig(num_pages=96, page_size=8, max_num_seqs=16,
                                                    max_num_batched_tokens=64, max_model_len=64))


def _actor_logps(cluster, out, temperature=1.0):
    from flax import nnx
    from tunix.rl import common

    C = cluster.cluster_config.rollout_config.max_tokens_to_generate
    comp = np.array([np.pad(t, (0, C - len(t))) for t in out.tokens], np.int32)
    graph, state = nnx.split(cluster.actor_trainer.model)
    ref = common.compute_per_token_logps(
        graph, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(comp), pad_id=0, eos_id=2, stop_gradient=True,
        return_logits=False, temperature=temperature)
    # Tunix masks pad ids inside a completion as padding; compare up to the first one.
    upto = [len(t) if 0 not in t.tolist() else t.tolist().index(0) for t in out.tokens]
    return np.asarray(ref), comp, upto


def test_grpo_step_logprobs_and_weight_sync(cluster):
    from flax import nnx

    rollout = cluster.rollout
    prompts = [p for p in PROMPTS for _ in range(G)]
    out = cluster.generate(prompts)
    assert rollout.policy_version == 0 and len(out.tokens) == len(prompts)
    assert rollout.group.last_backend == "api"  # through the controller, in chunks of 4 tokens
    assert {r.instance for r in rollout.last_responses} == {0, 1}  # groups spread over slices
    # 1. rollout logprobs == a forward pass of the actor at the same weights
    ref, comp, upto = _actor_logps(cluster, out)
    assert sum(upto) >= len(prompts) * 4
    for i, n in enumerate(upto):
        np.testing.assert_allclose(out.logprobs[i][:n], ref[i, :n], atol=1e-4)
    # samples of a group differ (per-request seeds) and prompts are left-padded
    assert len({tuple(t) for t in out.tokens[:G]}) > 1
    assert out.left_padded_prompt_tokens.shape == (len(prompts), 16)
    np.testing.assert_array_equal(out.left_padded_prompt_tokens[0, -7:], [1] + [ord(c) for c in "12+34="])
    # get_per_token_logps: recorded values for what we just generated == the forward path
    rec = np.asarray(rollout.get_per_token_logps(out.left_padded_prompt_tokens, comp))
    fwd = np.asarray(rollout.forward_logps(out.left_padded_prompt_tokens, comp))
    for i, n in enumerate(upto):
        np.testing.assert_allclose(rec[i, :n], fwd[i, :n], atol=1e-4)

    old = flat_np(rollout.group.params(0))

    # 2. one GRPO step end to end; reward: completions that contain a digit
    grpo_step(cluster, PROMPTS, G)
    assert cluster.actor_trainer.train_steps == 1
    assert rollout.policy_version == 1

    # 3. the engines serve exactly the trained actor's weights, and they moved
    actor_params = state_to_params(nnx.state(cluster.actor_trainer.model, nnx.Param), CFG)
    new = flat_np(rollout.group.params(0))
    moved = max(float(np.abs(new[k] - old[k]).max()) for k in new)
    assert moved > 1e-3
    for k, v in flat_np(actor_params).items():
        np.testing.assert_array_equal(new[k], v)
    for e, m in zip(rollout.group.engines, rollout.group.meshes, strict=True):
        assert params_on(e.runner.params, m)  # resharded to our tp rules on each slice

    # 4. the next rollout uses the new weights: greedy tokens == the reference generator at the
    #    new weights, logprobs == the new actor's forward and != the old weights' forward.
    greedy = dataclasses.replace(cluster.cluster_config.rollout_config, temperature=0.0)
    out2 = rollout.generate(prompts, greedy)
    assert all(r.policy_version == 1 for r in rollout.last_responses)
    ids = [[1] + [ord(c) for c in p] for p in PROMPTS]
    host_params = jax.tree.map(np.asarray, actor_params)
    want = generate(host_params, CFG, ids, 8, SamplingParams(temperature=0.0), eos_ids=(2,))
    for g in range(len(PROMPTS)):
        expect = want[g].token_ids[:-1] if want[g].finish_reason == "eos" else want[g].token_ids
        for s in range(G):
            assert out2.tokens[g * G + s].tolist() == expect
    ref2, _, upto2 = _actor_logps(cluster, out2)
    for i, n in enumerate(upto2):
        np.testing.assert_allclose(out2.logprobs[i][:n], ref2[i, :n], atol=1e-4)
    old_logits = full_forward(jax.tree.map(jnp.asarray, _unflatten_like(actor_params, old)), CFG,
                              jnp.asarray([ids[0] + out2.tokens[0].tolist()]))
    old_lp = jax.nn.log_softmax(old_logits[0, len(ids[0]) - 1:-1], axis=-1)
    old_lp = np.take_along_axis(np.asarray(old_lp), out2.tokens[0][:, None], axis=-1)[:, 0]
    n0 = upto2[0]
    assert np.abs(old_lp[:n0] - np.asarray(out2.logprobs[0][:n0])).max() > 1e-3


def _unflatten_like(params, flat_by_path):
    leaves_with_path = jax.tree_util.tree_leaves_with_path(params)
    treedef = jax.tree_util.tree_structure(params)
    return jax.tree_util.tree_unflatten(treedef, [flat_by_path[p] for p, _ in leaves_with_path])
