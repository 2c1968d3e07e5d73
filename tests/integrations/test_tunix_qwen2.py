"""SeerRollout with Tunix's own Qwen2 class as the actor (found by class: no model_config= or
param_mapping=): a GRPO step and weight sync, and a qwix LoRA actor whose adapters are merged on
sync."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.model.generate import full_forward, generate
from seer_jax.rollout.core.types import SamplingParams
from tests.integrations.tunix_tiny import (
    flat_np,
    grpo_cluster,
    grpo_step,
    randomize,
    tunix_logits,
    tunix_model,
)

pytest.importorskip("tunix")
pytestmark = pytest.mark.slow  # engines and a Tunix cluster: make test runs these

PROMPTS = ["12+34=", "7*8=", "99-5="]
IDS = [[1] + [ord(c) for c in p] for p in PROMPTS]
G = 4
ENGINE = EngineConfig(num_pages=96, page_size=8, max_num_seqs=16, max_num_batched_tokens=64,
                      max_model_len=64)
GREEDY = SamplingParams(temperature=0.0)




def _expected_tokens(host_params, cfg, max_tokens=8):
    """Reference greedy completions as SeerRollout returns them (final EOS dropped)."""
    want = generate(host_params, cfg, IDS, max_tokens, GREEDY, eos_ids=(2,))
    return [w.token_ids[:-1] if w.finish_reason == "eos" else w.token_ids for w in want]


@pytest.fixture(scope="module")
def cluster():
    return grpo_cluster(tunix_model("qwen2"), (4, 2), ENGINE)


def test_grpo_step_with_a_tunix_qwen2_actor(cluster):
    from flax import nnx
    from tunix.rl import common

    from seer_jax.integrations.tunix_models import FAMILIES
    from seer_jax.integrations.weight_sync import state_to_params

    rollout = cluster.rollout
    cfg = rollout.cfg
    assert (cfg.architecture, cfg.qkv_bias, cfg.vocab_size) == ("Qwen2ForCausalLM", True, 128)
    qwen2 = next(f for f in FAMILIES if f.name == "qwen2")
    prompts = [p for p in PROMPTS for _ in range(G)]
    out = cluster.generate(prompts)
    assert rollout.policy_version == 0 and len(out.tokens) == len(prompts)
    # rollout logprobs == the Qwen2 actor's own forward at the same weights
    C = 8
    comp = np.array([np.pad(t, (0, C - len(t))) for t in out.tokens], np.int32)
    graph, state = nnx.split(cluster.actor_trainer.model)
    ref = np.asarray(common.compute_per_token_logps(
        graph, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
        completion_tokens=jnp.asarray(comp), pad_id=0, eos_id=2, stop_gradient=True,
        return_logits=False, temperature=1.0))
    upto = [len(t) if 0 not in t.tolist() else t.tolist().index(0) for t in out.tokens]
    assert sum(upto) >= len(prompts) * 4
    for i, n in enumerate(upto):
        np.testing.assert_allclose(out.logprobs[i][:n], ref[i, :n], atol=1e-4)
    old = flat_np(rollout.group.params(0))

    grpo_step(cluster, PROMPTS, G)
    assert cluster.actor_trainer.train_steps == 1 and rollout.policy_version == 1

    # the engines serve the trained Qwen2's weights, mapped to our layout, and they moved
    trained = state_to_params(nnx.state(cluster.actor_trainer.model, nnx.Param), cfg, qwen2.mapping)
    new = flat_np(rollout.group.params(0))
    assert max(float(np.abs(new[k] - old[k]).max()) for k in new) > 1e-3
    for k, v in flat_np(trained).items():
        np.testing.assert_array_equal(new[k], v)
    # the next rollout: greedy tokens == the reference generator at the new weights
    import dataclasses

    greedy = dataclasses.replace(cluster.cluster_config.rollout_config, temperature=0.0)
    out2 = rollout.generate(prompts, greedy)
    assert all(r.policy_version == 1 for r in rollout.last_responses)
    expect = _expected_tokens(jax.tree.map(np.asarray, trained), cfg)
    assert [t.tolist() for t in out2.tokens] == [e for e in expect for _ in range(G)]


@pytest.mark.exhaustive
def test_lora_actor_syncs_merged_weights():
    import qwix
    from flax import nnx
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from seer_jax.integrations.tunix import CharTokenizer, SeerRollout

    base = tunix_model("qwen2", seed=3)
    provider = qwix.LoraProvider(module_path=".*(q_proj|o_proj|up_proj|down_proj)", rank=2,
                                 alpha=4.0)
    model = qwix.apply_lora_to_model(base, provider, **base.get_model_input(), rngs=nnx.Rngs(1))
    randomize(model, 7, nnx.LoRAParam)
    rc = RolloutConfig(max_tokens_to_generate=8, temperature=0.0, max_prompt_length=16)
    ro = SeerRollout(model, CharTokenizer(), None, rc, num_instances=1, tp=1, engine_config=ENGINE)
    assert ro.cfg.architecture == "Qwen2ForCausalLM"

    def check():
        served = jax.tree.map(np.asarray, ro.group.params(0))
        toks = np.asarray([IDS[0] + [40, 41, 42]])
        want = tunix_logits(model, toks)  # the LoRA model's forward
        got = np.asarray(full_forward(served, ro.cfg, jnp.asarray(toks)))
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
        out = ro.generate(PROMPTS, rc)
        assert [t.tolist() for t in out.tokens] == _expected_tokens(served, ro.cfg)

    check()
    # a training step under LoRA changes only the adapters, and Tunix syncs only those
    randomize(model, 11, nnx.LoRAParam)
    ro.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
    assert ro.policy_version == 1
    check()
