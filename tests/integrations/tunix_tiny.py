"""Tiny Tunix Llama3 / Qwen2 / Qwen3 / Qwen3-MoE models with every parameter random (Tunix initialises MLP
kernels and biases to zero and norms to one, which would hide a mapping mistake)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 128


def tunix_model(family: str, tied: bool = False, seed: int = 0, rope_theta: int = 10_000):
    from flax import nnx

    if family == "llama3":
        from tunix.models.llama3 import model as m
        cls, kw = m.Llama3, {"weight_tying": tied}
    elif family == "qwen2":
        from tunix.models.qwen2 import model as m
        cls, kw = m.Qwen2, {"use_tied_embedding": tied}
    elif family == "qwen3":
        from tunix.models.qwen3 import model as m
        cls, kw = m.Qwen3, {"use_tied_embedding": tied}
    else:  # qwen3_moe: 8 experts, 2 per token, each of intermediate size 32
        from tunix.models.qwen3 import model as m
        cls, kw = m.Qwen3, {"use_tied_embedding": tied, "num_experts": 8,
                            "num_experts_per_tok": 2, "hidden_dim": 32}
    kw = {"hidden_dim": 96, **kw}
    cfg = m.ModelConfig(num_layers=2, vocab_size=VOCAB, embed_dim=64, num_heads=4,
                        head_dim=16, num_kv_heads=2, rope_theta=rope_theta, norm_eps=1e-6, **kw)
    model = cls(cfg, rngs=nnx.Rngs(seed))
    randomize(model, seed)
    return model


def randomize(model, seed: int, filter_type=None) -> None:
    """Every parameter (of `filter_type`, default nnx.Param) drawn at random: norms near 1,
    other weights N(0, 1/fan_in)."""
    from flax import nnx

    state = nnx.state(model, filter_type or nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    rng = np.random.RandomState(seed + 1)
    new = []
    for path, v in leaves:
        name = jax.tree_util.keystr(path)
        x = rng.standard_normal(v.shape).astype(np.float32)
        if "norm" in name:
            x = 1.0 + 0.1 * x
        elif "bias" in name:
            x = 0.1 * x
        elif "mlp" in name and v.ndim == 3:  # stacked experts [E, fan_in, out]
            x = x / np.sqrt(v.shape[1])
        else:
            x = x / np.sqrt(v.shape[0] if v.ndim > 1 and "embedding" not in name else 1.0)
        new.append(jnp.asarray(x, v.dtype))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, new))
    nnx.update(model, state)


def tunix_logits(model, tokens_bt) -> np.ndarray:
    """The Tunix model's own forward (causal mask, positions 0..T-1)."""
    tokens = jnp.asarray(tokens_bt, jnp.int32)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    logits, _ = model(tokens, positions, None, mask)
    return np.asarray(logits, np.float32)


def grpo_cluster(actor, mesh_shape: tuple[int, int], engine_config, **rollout_kw):
    """A Tunix RLCluster for one GRPO step on 8 CPU devices: `actor`, a (fsdp, tp) mesh of
    `mesh_shape` for every role, SeerRollout over 2 slices x tp2 (chunks of 4 tokens; other
    SeerRollout arguments in rollout_kw), sampling 8 tokens at temperature 1 with logprobs, SGD
    at 0.5, a character tokenizer."""
    import functools

    import optax
    from tunix.rl import rl_cluster as rl
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from seer_jax.integrations.tunix import CharTokenizer, SeerRollout

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(mesh_shape), ("fsdp", "tp"))
    rollout_config = RolloutConfig(max_tokens_to_generate=8, temperature=1.0, top_p=1.0,
                                   top_k=None, max_prompt_length=16, return_logprobs=True, seed=7)
    engine = functools.partial(SeerRollout, **{
        "num_instances": 2, "tp": 2, "controller_config": {"chunk_size": 4},
        "engine_config": engine_config, **rollout_kw})
    config = rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine=engine,
        training_config=rl.RLTrainingConfig(actor_optimizer=optax.sgd(0.5), eval_every_n_steps=100,
                                            max_steps=1),
        rollout_config=rollout_config,
    )
    return rl.RLCluster(actor=actor, tokenizer=CharTokenizer(), cluster_config=config)


def flat_np(params) -> dict:
    """A params tree's leaves as host arrays, keyed by their tree path."""
    return {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def grpo_step(cluster, prompts: list[str], group_size: int) -> None:
    """One GRPO step on `cluster` over `prompts` (reward: the digits in a completion)."""
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner

    def reward(prompts, completions, **kw):
        return [float(sum(c.isdigit() for c in text)) for text in completions]

    learner = GRPOLearner(rl_cluster=cluster, reward_fns=[reward],
                          algo_config=GRPOConfig(num_generations=group_size, num_iterations=1,
                                                 beta=0.0))
    learner.train([{"prompts": np.array(prompts)}])
