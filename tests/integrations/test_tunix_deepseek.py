"""A DeepSeek-V3 policy (multi-head latent attention, the DeepSeek MoE block) trained by Tunix's
GRPOLearner as a `TunixLlama` actor, served by SeerRollout given its `model_config`: the rollout's
logprobs are the actor's own on the sampled tokens, and after a GRPO step the engines hold the
updated actor's weights (latent projections, stacked experts) and compute its logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.model.generate import generate
from seer_jax.model.loading import load_safetensors_dir
from seer_jax.model.tiny_checkpoint import write_tiny_checkpoint
from seer_jax.rollout.core.types import SamplingParams
from tests.integrations.tunix_tiny import flat_np, grpo_cluster, grpo_step

pytest.importorskip("tunix")
pytestmark = pytest.mark.slow  # engines and a Tunix cluster: make test runs these

PROMPTS = ["12+34=", "7*8="]
IDS = [[1] + [ord(c) for c in p] for p in PROMPTS]
G = 2
ENGINE = EngineConfig(num_pages=48, page_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=64)
# one slice on one device; 2 slices with the experts split over each slice's 2 devices
LAYOUTS = [pytest.param((1, 1, (8, 1)), id="1slice"),
           pytest.param((2, 2, (4, 2)), id="2slices-ep2", marks=pytest.mark.exhaustive)]


def _actor_logps(cluster, out, temperature=1.0):
    """The actor's logprobs of the completions (Tunix's `compute_per_token_logps`, as its GRPO
    loss computes them) and each completion's length up to its first pad id (Tunix masks the
    rest)."""
    from flax import nnx
    from tunix.rl import common

    C = cluster.cluster_config.rollout_config.max_tokens_to_generate
    comp = np.array([np.pad(t, (0, C - len(t))) for t in out.tokens], np.int32)
    graph, state = nnx.split(cluster.actor_trainer.model)
    ref = common.compute_per_token_logps(
        graph, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(comp), pad_id=0, eos_id=2, stop_gradient=True,
        return_logits=False, temperature=temperature)
    upto = [len(t) if 0 not in t.tolist() else t.tolist().index(0) for t in out.tokens]
    return np.asarray(ref), upto


def _assert_logps_equal(out, ref, upto):
    assert sum(upto) >= len(out.tokens) * 4
    for i, n in enumerate(upto):
        np.testing.assert_allclose(out.logprobs[i][:n], ref[i, :n], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    write_tiny_checkpoint(path, "DeepseekV3ForCausalLM")
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_step_with_a_deepseek_v3_actor(checkpoint, layout):
    from flax import nnx

    from seer_jax.integrations.nnx_actor import TunixLlama

    slices, tp, mesh_shape = layout
    cfg, params = load_safetensors_dir(checkpoint)
    assert cfg.mla is not None and cfg.moe is not None and cfg.layer_kinds == ("dense", "moe", "moe")
    # the actor on the trainer's mesh: experts and heads over its "tp" axis
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(mesh_shape), ("fsdp", "tp"))
    actor = TunixLlama.from_checkpoint(str(checkpoint), mesh=mesh)
    assert actor.cfg == cfg
    for k, v in flat_np(params).items():
        np.testing.assert_array_equal(flat_np(actor.params())[k], v)
    cluster = grpo_cluster(actor, mesh_shape, ENGINE, model_config=cfg, num_instances=slices, tp=tp)
    rollout = cluster.rollout
    assert rollout.cfg == cfg and len(rollout.group.meshes) == slices
    if tp == 2:  # experts split over the trainer's tp devices and over each slice's
        we_gate = cluster.actor_trainer.model.params()["layers"]["we_gate"]
        assert we_gate.sharding.shard_shape(we_gate.shape) == (2, 4, 64, 32)
        assert rollout.group.params(0)["layers"]["we_gate"].sharding.shard_shape((2, 8, 64, 32)) \
            == (2, 4, 64, 32)

    # 1. the rollout's logprobs == the actor's forward on the sampled tokens (float32 rounding)
    prompts = [p for p in PROMPTS for _ in range(G)]
    out = cluster.generate(prompts)
    assert rollout.policy_version == 0 and len(out.tokens) == len(prompts)
    assert {r.instance for r in rollout.last_responses} == set(range(slices))
    _assert_logps_equal(out, *_actor_logps(cluster, out))
    old = flat_np(rollout.group.params(0))

    # 2. one GRPO step; the sync maps every tensor name for name into the engines
    grpo_step(cluster, PROMPTS, G)
    assert cluster.actor_trainer.train_steps == 1 and rollout.policy_version == 1
    trained = nnx.to_pure_dict(nnx.state(cluster.actor_trainer.model, nnx.Param))
    new = flat_np(rollout.group.params(0))
    for k, v in flat_np(trained).items():
        np.testing.assert_array_equal(new[k], v)
    moved = {jax.tree_util.keystr(k) for k in new if float(np.abs(new[k] - old[k]).max()) > 1e-5}
    for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "we_gate", "we_down", "ws_up", "router",
                 "w_up", "embed"):
        assert any(f"'{name}'" in k for k in moved), name

    # 3. the next rollout computes the updated actor's logits: its logprobs == the actor's
    #    forward, greedy tokens == the reference generator at the trained weights
    out2 = cluster.generate(prompts)
    assert all(r.policy_version == 1 for r in rollout.last_responses)
    _assert_logps_equal(out2, *_actor_logps(cluster, out2))
    greedy = dataclasses.replace(cluster.cluster_config.rollout_config, temperature=0.0)
    out3 = rollout.generate(prompts, greedy)
    host = jax.tree.map(np.asarray, trained)
    want = generate(host, cfg, IDS, 8, SamplingParams(temperature=0.0), eos_ids=(2,))
    expect = [w.token_ids[:-1] if w.finish_reason == "eos" else w.token_ids for w in want]
    assert [t.tolist() for t in out3.tokens] == [e for e in expect for _ in range(G)]
