"""SeerRollout(backend='ray') on one local loopback Ray cluster (module-scoped): the same
completions and logprobs as the in-process rollout, and weight sync through the object store."""

import os

import jax
import numpy as np
import pytest

from seer_jax.engine.engine import EngineConfig
from seer_jax.model.generate import generate
from seer_jax.rollout.core.types import SamplingParams
from tests.integrations.tunix_tiny import tunix_model

pytest.importorskip("tunix")
# a Ray cluster and engines: make test runs these (on the worker that holds the cluster),
# test-fast does not
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

PROMPTS = ["12+34=", "7*8=", "99-5="]
G = 3
ENGINE = EngineConfig(num_pages=96, page_size=8, max_num_seqs=16, max_num_batched_tokens=64,
                      max_model_len=64)


@pytest.fixture(scope="module")
def ray_backend(ray_cluster):
    from seer_jax.rollout.backends.ray_cluster import RayBackendConfig

    return RayBackendConfig(step_timeout_s=120.0, object_store_mb=200, num_cpus=4)


def _rollouts(actor, ray_backend):
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from seer_jax.integrations.tunix import CharTokenizer, SeerRollout

    rc = RolloutConfig(max_tokens_to_generate=8, temperature=1.0, max_prompt_length=16,
                       return_logprobs=True, seed=3)
    common = dict(num_instances=2, tp=1, controller_config={"chunk_size": 4}, engine_config=ENGINE)
    remote = SeerRollout(actor, CharTokenizer(), None, rc, backend="ray", ray_backend=ray_backend,
                         **common)
    local = SeerRollout(actor, CharTokenizer(), None, rc, **common)
    return rc, remote, local


def test_ray_rollout_equals_inprocess_and_syncs_weights(ray_backend):
    import dataclasses

    from flax import nnx

    from tests.integrations.tunix_tiny import randomize

    actor = tunix_model("qwen2")
    rc, remote, local = _rollouts(actor, ray_backend)
    try:
        prompts = [p for p in PROMPTS for _ in range(G)]
        a, b = remote.generate(prompts, rc), local.generate(prompts, rc)
        assert remote.group.last_backend == "ray" and local.group.last_backend == "api"
        assert {r.instance for r in remote.last_responses} == {0, 1}
        pids = {inst.snap.pid for inst in remote.group.actors.instances}
        assert len(pids) == 2 and os.getpid() not in pids  # the engines ran in the actors
        # sampled (T=1) completions: same tokens, same logprobs, whatever process ran them
        assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
        assert len({tuple(t) for t in a.tokens[:G]}) > 1
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            np.testing.assert_allclose(x, y, atol=1e-5)
        # new weights through the object store; the next greedy rollout follows them
        randomize(actor, 21)
        state = nnx.state(actor, nnx.Param)
        for ro in (remote, local):
            ro.update_params(state)
            assert ro.policy_version == 1
        served = jax.tree.map(np.asarray, local.group.params(0))
        for k, v in jax.tree_util.tree_leaves_with_path(remote.group.params(0)):
            np.testing.assert_array_equal(v, _at(served, k))
        greedy = dataclasses.replace(rc, temperature=0.0)
        out = remote.generate(prompts, greedy)
        assert all(r.policy_version == 1 for r in remote.last_responses)
        ids = [[1] + [ord(c) for c in p] for p in PROMPTS]
        want = generate(served, remote.cfg, ids, 8, SamplingParams(temperature=0.0), eos_ids=(2,))
        expect = [w.token_ids[:-1] if w.finish_reason == "eos" else w.token_ids for w in want]
        assert [t.tolist() for t in out.tokens] == [e for e in expect for _ in range(G)]
        # logprobs of what we just generated: the recorded ones == a forward at the new weights
        C = 8
        comp = np.array([np.pad(t, (0, C - len(t))) for t in out.tokens], np.int32)
        rec = np.asarray(remote.get_per_token_logps(out.left_padded_prompt_tokens, comp))
        fwd = np.asarray(remote.forward_logps(out.left_padded_prompt_tokens, comp))
        for i, t in enumerate(out.tokens):
            np.testing.assert_allclose(rec[i, :len(t)], fwd[i, :len(t)], atol=1e-4)
    finally:
        remote.shutdown()


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


@pytest.mark.exhaustive  # Tunix on Ray and speculation on Ray run in make test, apart
def test_grpo_step_on_ray_with_grouped_speculation(ray_backend):
    """A GRPO step whose rollouts run on two Ray actors drafting from the distributed draft
    service; after the weight sync the greedy tokens follow the new weights exactly (drafts
    depend on tokens only: the sync clears nothing they need)."""
    import dataclasses

    from tests.integrations.tunix_tiny import grpo_cluster, grpo_step

    actor = tunix_model("llama3")
    engine = dataclasses.replace(ENGINE, speculation=True)
    cluster = grpo_cluster(actor, (4, 2), engine, tp=1, backend="ray", ray_backend=ray_backend)
    rollout = cluster.rollout
    try:
        grpo_step(cluster, PROMPTS, G)
        assert cluster.actor_trainer.train_steps == 1 and rollout.policy_version == 1
        assert rollout.group.last_backend == "ray"
        stats = rollout.group.actors.draft_stats()["replicas"]
        assert stats["pushes"] > 0 and stats["bytes_pushed"] > 0
        rc = dataclasses.replace(cluster.cluster_config.rollout_config, temperature=0.0)
        prompts = [p for p in PROMPTS for _ in range(G)]
        out = rollout.generate(prompts, rc)
        served = rollout.group.params(0)
        ids = [[1] + [ord(c) for c in p] for p in PROMPTS]
        want = generate(served, rollout.cfg, ids, 8, SamplingParams(temperature=0.0), eos_ids=(2,))
        expect = [w.token_ids[:-1] if w.finish_reason == "eos" else w.token_ids for w in want]
        assert [t.tolist() for t in out.tokens] == [e for e in expect for _ in range(G)]
        assert all(r.policy_version == 1 for r in rollout.last_responses)
    finally:
        rollout.shutdown()
