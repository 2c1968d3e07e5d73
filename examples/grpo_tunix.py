"""GRPO with Tunix on seer_jax rollout engines: multi-digit addition with a verifiable reward.

    python examples/grpo_tunix.py                         # tiny random model, configs/demo.py, CPU
    python examples/grpo_tunix.py --model smollm2 --config.trainer.learning_rate=1e-5
                                                          # SmolLM2-135M-Instruct (seer-jax fetch-model smollm2)
    python examples/grpo_tunix.py --config.trainer.num_steps=5 --out /tmp/grpo

Tunix's `GRPOLearner` trains the policy (`TunixLlama`, our decoder as an NNX module) on one device;
rollouts run on `SeerRollout`: `config.mesh.num_instances` engines of `config.mesh.tp` devices,
fed whole groups through the controller with `config.policies`. After every step Tunix syncs the
weights into the engines (device to device) and the next rollout reports the new policy version.
Checkpoints: Tunix's own Orbax checkpoints every step under OUT/tunix, and the final policy as a
seer_jax Orbax checkpoint under OUT/policy (`seer-jax generate --model OUT/policy` loads it).
Prints one line per step and writes OUT/grpo_tunix.json (with a top-level `summary`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.py"))
    p.add_argument("--model", default="config",
                   help="'config' (config.model.name), 'tiny', 'smollm2', or a model path")
    p.add_argument("--out", default="/tmp/seer_grpo_tunix")
    p.add_argument("--digits", type=int, default=2, help="digits per operand")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--config.")]
    if bad:
        p.error(f"unrecognized arguments: {bad}")
    args.config_overrides = rest
    return args


def problems(n: int, digits: int, seed: int) -> list[tuple[str, str]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lo, hi = 10 ** (digits - 1), 10 ** digits
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(lo, hi, 2))
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def score(completion: str, answer: str) -> float:
    """1 for the exact answer first, plus up to 0.5 for digits where the answer's digits go."""
    text = completion.strip()
    head = text[:len(answer)]
    digits = sum(c.isdigit() for c in head) / len(answer)
    exact = text.startswith(answer) and (len(text) == len(answer) or not text[len(answer)].isdigit())
    return float(exact) + 0.5 * digits


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from seer_jax.config_files import load_config_file
    from seer_jax.integrations.deploy_config import engine_config, model_config, validate_config
    from seer_jax.integrations.nnx_actor import TunixLlama
    from seer_jax.integrations.tunix import CharTokenizer, SeerRollout, TunixTokenizer
    from seer_jax.model.loading import load_orbax, save_orbax

    c = load_config_file(args.config, args.config_overrides)
    name = c.model.name if args.model == "config" else args.model
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t = c.trainer
    if t.beta:
        raise SystemExit(f"config.trainer.beta={t.beta}: this example trains without a KL term "
                         "(beta=0, no reference model)")
    if name == "tiny":
        validate_config(c)
        cfg = model_config(c)
        if cfg.vocab_size < CharTokenizer.vocab_size:
            raise SystemExit(f"config.model.vocab_size={cfg.vocab_size}: the tiny model's character "
                             f"tokenizer needs >= {CharTokenizer.vocab_size}")
        actor = TunixLlama(cfg, rngs=nnx.Rngs(params=t.seed))
        tokenizer = CharTokenizer()
        render = lambda q: q
    else:
        from seer_jax.model import load

        cfg, params, tok = load(name)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                    "architecture", "rope_theta", "rms_norm_eps", "dtype"):
            c.model[key] = getattr(cfg, key)
        if cfg.num_heads % c.mesh.tp:  # e.g. SmolLM2's 9 heads: one device per instance
            print(f"note: {name} has {cfg.num_heads} heads; using tp=1 instead of tp={c.mesh.tp}")
            c.mesh.tp, c.mesh.devices = 1, c.mesh.num_instances
        validate_config(c)
        actor = TunixLlama(cfg, rngs=nnx.Rngs(params=0))
        actor.set_params(params)
        tokenizer = TunixTokenizer(tok)
        render = lambda q: tok.apply_chat_template(
            [{"role": "user", "content": f"Compute {q} Answer with the number only."}])
    devices = jax.devices()
    if c.mesh.devices > len(devices):
        raise SystemExit(f"config.mesh.devices={c.mesh.devices} but only {len(devices)} devices are "
                         "present (on CPU raise --xla_force_host_platform_device_count)")
    rollout_mesh = jax.sharding.Mesh(np.array(devices[:c.mesh.devices]).reshape(1, -1), ("fsdp", "tp"))
    actor_mesh = jax.sharding.Mesh(np.array(devices[:1]).reshape(1, 1), ("fsdp", "tp"))
    s = c.sampling
    rollout_config = RolloutConfig(
        max_tokens_to_generate=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k or None, max_prompt_length=s.max_prompt_length, return_logprobs=True)
    engine = _partial(SeerRollout, num_instances=c.mesh.num_instances, tp=c.mesh.tp,
                      engine_config=engine_config(c), policy=c.policies,
                      controller_config=c.controller.to_dict(),
                      policy_options=c.policy.to_dict().get(c.policies, {}))
    cluster = rl.RLCluster(
        actor=actor, tokenizer=tokenizer,
        cluster_config=rl.ClusterConfig(
            role_to_mesh={rl.Role.ACTOR: actor_mesh, rl.Role.REFERENCE: actor_mesh,
                          rl.Role.ROLLOUT: rollout_mesh},
            rollout_engine=engine, rollout_config=rollout_config,
            training_config=rl.RLTrainingConfig(
                actor_optimizer=optax.adam(t.learning_rate), eval_every_n_steps=10**9,
                max_steps=t.num_steps, checkpoint_root_directory=str(out / "tunix"),
                checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1,
                                                                   max_to_keep=2))))

    history: list[dict] = []
    clock = {"t": time.perf_counter()}

    def reward(prompts, completions, answer, **_):
        scores = [score(comp, str(ans)) for comp, ans in zip(completions, answer, strict=True)]
        rs = cluster.rollout.last_responses
        now = time.perf_counter()
        history.append(dict(
            step=len(history), policy_version=rs[0].policy_version, backend=cluster.rollout.group.last_backend,
            mean_reward=float(np.mean(scores)), exact=float(np.mean([x >= 1.0 for x in scores])),
            mean_tokens=float(np.mean([len(r.token_ids) for r in rs])), seconds=now - clock["t"],
            sample=completions[0][:24]))
        clock["t"] = now
        h = history[-1]
        print(f"step {h['step']:3d}  policy v{h['policy_version']}  reward {h['mean_reward']:.3f}  "
              f"exact {h['exact']:.2f}  tokens {h['mean_tokens']:5.1f}  {h['seconds']:6.1f}s  "
              f"sample {h['sample']!r}", flush=True)
        return scores

    batches = []
    for step in range(t.num_steps):
        items = problems(t.batch_size, args.digits, seed=t.seed * 1000 + step)
        batches.append({"prompts": np.array([render(q) for q, _ in items]),
                        "answer": np.array([a for _, a in items])})
    learner = GRPOLearner(rl_cluster=cluster, reward_fns=[reward],
                          algo_config=GRPOConfig(num_generations=s.group_size, num_iterations=1,
                                                 beta=0.0))
    t0 = time.perf_counter()
    learner.train(batches)
    train_s = time.perf_counter() - t0

    policy = nnx.state(cluster.actor_trainer.model, nnx.Param)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(policy))
    path = save_orbax(out / "policy", cfg, params)
    _, back = load_orbax(path)
    same = all(np.array_equal(a, np.asarray(b)) for a, b in
               zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True))
    served = jax.tree.map(np.asarray, cluster.rollout.group.params(0))
    synced = all(np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(params), jax.tree.leaves(served), strict=True))
    summary = {
        "model": name, "config": pathlib.Path(args.config).name, "steps": t.num_steps,
        "responses_per_step": t.batch_size * s.group_size,
        "num_instances": c.mesh.num_instances, "tp": c.mesh.tp, "policy": c.policies,
        "rollout_backend": cluster.rollout.group.last_backend,
        "mean_reward_first": history[0]["mean_reward"] if history else None,
        "mean_reward_last": history[-1]["mean_reward"] if history else None,
        "final_policy_version": cluster.rollout.policy_version,
        "engines_serve_final_policy": synced,
        "orbax_roundtrip_equal": same, "train_seconds": train_s,
        "checkpoint": str(path), "tunix_checkpoints": str(out / "tunix"),
    }
    (out / "grpo_tunix.json").write_text(json.dumps({"summary": summary, "steps": history}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if (synced and same) else 1


def _partial(fn, **kw):
    import functools

    return functools.partial(fn, **kw)


if __name__ == "__main__":
    sys.exit(main())
