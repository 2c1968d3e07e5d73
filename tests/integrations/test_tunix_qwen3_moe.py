"""SeerRollout with Tunix's Qwen3 mixture of experts as the actor: a GRPO step over 2 slices with
experts sharded (tp/ep 2), weight sync mapping its expert tensors, and the rollout's routed
experts equal to the routing of the trainer's own forward over prompt + completion."""

import dataclasses

import jax
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.model.generate import generate
from seer_jax.rollout.core.types import SamplingParams
from tests.integrations.tunix_tiny import flat_np, grpo_cluster, grpo_step, tunix_model

pytest.importorskip("tunix")
# engines and a Tunix cluster (~90 s on 2 cores): make test-all runs it
pytestmark = [pytest.mark.slow, pytest.mark.exhaustive]

PROMPTS = ["12+34=", "7*8=", "99-5="]
IDS = [[1] + [ord(c) for c in p] for p in PROMPTS]
G = 2
ENGINE = EngineConfig(num_pages=96, page_size=8, max_num_seqs=16, max_num_batched_tokens=64,
                      max_model_len=64, return_routed_experts=True)


def tunix_routing(model, tokens: list[int]) -> np.ndarray:
    """The expert ids Tunix's own forward routes over `tokens`: [T, layers, k] (its MoELayer
    picks them with jax.lax.top_k, recorded here)."""
    from tests.integrations.tunix_tiny import tunix_logits

    picked = []
    top_k = jax.lax.top_k

    def record(x, k):
        out = top_k(x, k)
        picked.append(np.asarray(out[1]))
        return out

    jax.lax.top_k = record
    try:
        tunix_logits(model, np.array([tokens]))
    finally:
        jax.lax.top_k = top_k
    return np.stack([p[0] for p in picked], 1)


@pytest.fixture(scope="module")
def cluster():
    return grpo_cluster(tunix_model("qwen3_moe"), (4, 2), ENGINE)


def test_grpo_step_with_a_tunix_qwen3_moe_actor(cluster):
    from flax import nnx

    from seer_jax.integrations.tunix_models import FAMILIES
    from seer_jax.integrations.weight_sync import state_to_params

    rollout = cluster.rollout
    cfg = rollout.cfg
    assert (cfg.architecture, cfg.moe.num_experts, cfg.num_moe_layers) == ("Qwen3MoeForCausalLM", 8, 2)
    # experts split over each slice's 2 devices
    assert rollout.group.params(0)["layers"]["we_gate"].sharding.shard_shape((2, 8, 64, 32)) == \
        (2, 4, 64, 32)
    qwen3 = next(f for f in FAMILIES if f.name == "qwen3")
    prompts = [p for p in PROMPTS for _ in range(G)]
    out = cluster.generate(prompts)
    assert rollout.policy_version == 0 and len(out.tokens) == len(prompts)
    # the routed experts of every generated token == the Tunix actor's own routing
    routed = rollout.last_routed_experts
    assert len(routed) == len(prompts)
    model = cluster.actor_trainer.model
    for i, (toks, ids) in enumerate(zip(out.tokens, routed, strict=True)):
        prompt = IDS[i // G]
        assert ids.shape[0] in (len(toks), len(toks) + 1) and ids.shape[1:] == (2, 2)
        want = tunix_routing(model, prompt + toks.tolist())[len(prompt) - 1:]
        assert np.array_equal(np.sort(ids, -1), np.sort(want[:len(ids)], -1)), i
    old = flat_np(rollout.group.params(0))

    grpo_step(cluster, PROMPTS, G)
    assert cluster.actor_trainer.train_steps == 1 and rollout.policy_version == 1

    # the engines serve the trained model's weights (experts included), and they moved
    trained = state_to_params(nnx.state(cluster.actor_trainer.model, nnx.Param), cfg, qwen3.mapping)
    new = flat_np(rollout.group.params(0))
    moved = {str(k) for k in new if float(np.abs(new[k] - old[k]).max()) > 1e-4}
    assert any("we_gate" in k for k in moved) and any("router" in k for k in moved)
    for k, v in flat_np(trained).items():
        np.testing.assert_array_equal(new[k], v)
    # the next rollout: greedy tokens == the reference generator at the new weights
    greedy = dataclasses.replace(cluster.cluster_config.rollout_config, temperature=0.0)
    out2 = rollout.generate(prompts, greedy)
    host = jax.tree.map(np.asarray, trained)
    want = generate(host, cfg, IDS, 8, SamplingParams(temperature=0.0), eos_ids=(2,))
    expect = [w.token_ids[:-1] if w.finish_reason == "eos" else w.token_ids for w in want]
    assert [t.tolist() for t in out2.tokens] == [e for e in expect for _ in range(G)]
