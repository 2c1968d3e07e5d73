"""A GRPO job on Tunix's `GRPOLearner` with a chosen rollout engine, measured step by step.

`run_grpo(GrpoSettings(...))` trains a policy on a verifiable task (single-digit addition,
`score` is the exact reward) and returns a report: per step the reward, the rollout / train /
sync seconds, rollout tokens/s, the policy version the rollout served next to the trainer step,
and how far the rollout's logprobs are from the trainer's own forward on the sampled tokens
(`mismatch_stats`). The rollout engine is Tunix's `VanillaRollout` (`engine="vanilla"`, the
sampler Tunix ships: dense KV cache, static batches) or `SeerRollout` (`engine="seer"`, `slices`
in-process engines behind the controller). Both see the same actor, prompts, sampling seeds and
meshes: the actor trains on device 0, the rollout runs on devices 1..slices (its own copy of the
weights, synced after every step).

Checkpoints: Tunix's Orbax checkpoints under OUT/tunix after every step. Running again with the
same OUT resumes: the trainer restores the policy and optimizer, the rollout gets the restored
weights and reports the restored step as its policy version, and training continues with the
batch of that step.

A reward function that raises, returns NaN/inf or the wrong number of rewards stops the run with
an `InputError` naming the step, the prompt and the completion; the checkpoints written so far
are kept (`run_grpo` closes the trainer, which flushes them, before raising).

The actor is any Tunix model the vanilla sampler can run (it needs `config` and a KV cache); by
default `tiny_actor` builds a small random Tunix Llama3 over the character tokenizer. `actor_fn`
and `tokenizer` take another model (e.g. a Tunix MoE or a pretrained checkpoint), so the same
measurements apply to it.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from seer_jax.errors import ConfigError, InputError

ENGINES = ("vanilla", "seer")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class GrpoSettings:
    engine: str = "seer"  # vanilla (Tunix's VanillaRollout) | seer (SeerRollout)
    slices: int = 1  # seer: engine instances (one device each); vanilla: must be 1
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 2  # the answer (one digit) and EOS
    max_prompt_length: int = 8
    temperature: float = 1.0
    learning_rate: float = 3e-3
    seed: int = 0  # model init, prompts and sampling seeds
    rollout_dtype: str = "float32"  # the rollout's weights; the trainer stays float32
    operand_max: int = 4  # a+b with 0 <= a, b <= operand_max
    num_layers: int = 2
    embed_dim: int = 64
    hidden_dim: int = 128
    chunk_size: int = 4  # seer: tokens per controller chunk (divided rollout)
    policy: str = "seer"  # seer: the controller's scheduling policy
    speculation: bool = False  # seer: grouped speculative decoding
    mismatch: bool = True  # measure rollout vs trainer logprobs every step (timed apart)
    out: str = ""  # checkpoint directory (OUT/tunix); "" = no checkpoints

    def validate(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine={self.engine!r}: allowed {list(ENGINES)}")
        if self.rollout_dtype not in DTYPES:
            raise ConfigError(f"rollout_dtype={self.rollout_dtype!r}: allowed {list(DTYPES)}")
        if self.engine == "vanilla" and self.slices != 1:
            raise ConfigError(f"slices={self.slices}: Tunix's VanillaRollout runs on one device")
        for key in ("slices", "steps", "prompts_per_step", "group_size", "max_tokens",
                    "max_prompt_length", "chunk_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature}: must be > 0 (GRPO samples)")
        if len(jax.devices()) < 1 + self.slices:
            raise ConfigError(f"slices={self.slices} needs {1 + self.slices} devices (the trainer's "
                              f"and one per slice), {len(jax.devices())} present (on CPU raise "
                              "--xla_force_host_platform_device_count)")


# ---------------------------------------------------------------------------------- task
def problems(n: int, operand_max: int, seed: int) -> list[tuple[str, str]]:
    """n addition prompts "a+b=" with their answers, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(0, operand_max + 1, 2))
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def score(completion: str, answer: str) -> float:
    """1 for the exact answer (its digits, then the end or a non-digit), plus up to 0.5 for how
    close the leading number is: 0.5 * (1 - |number - answer| / 10), 0 without a leading digit."""
    text = completion.strip()
    n = len(text) - len(text.lstrip("0123456789"))
    if n == 0:
        return 0.0
    value = int(text[:n])
    return float(text[:n] == answer) + 0.5 * max(0.0, 1.0 - abs(value - int(answer)) / 10)


def addition_reward(prompts, completions, answer, **_):
    return [score(c, str(a)) for c, a in zip(completions, answer, strict=True)]


def batch_for_step(s: GrpoSettings, step: int) -> dict[str, np.ndarray]:
    items = problems(s.prompts_per_step, s.operand_max, seed=s.seed * 100_003 + step)
    return {"prompts": np.array([q for q, _ in items]), "answer": np.array([a for _, a in items])}


# ---------------------------------------------------------------------------------- model
def tiny_actor(s: GrpoSettings):
    """A small Tunix Llama3 over the character tokenizer's 128 ids, every weight random (Tunix's
    own init zeroes the MLP kernels, which would leave them without gradient)."""
    from flax import nnx
    from tunix.models.llama3 import model as llama3

    cfg = llama3.ModelConfig(num_layers=s.num_layers, vocab_size=128, embed_dim=s.embed_dim,
                             hidden_dim=s.hidden_dim, num_heads=4, head_dim=s.embed_dim // 4,
                             num_kv_heads=2, rope_theta=10_000, norm_eps=1e-5)
    model = llama3.Llama3(cfg, rngs=nnx.Rngs(s.seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    rng = np.random.default_rng(s.seed + 1)
    new = []
    for path, v in leaves:
        name = jax.tree_util.keystr(path)
        x = rng.standard_normal(v.shape).astype(np.float32)
        if "norm" in name or "scale" in name:
            x = np.ones(v.shape, np.float32)
        elif "embed" in name:
            x = x * 0.5
        elif "o_proj" in name:  # (heads, head_dim, embed)
            x = x / np.sqrt(v.shape[0] * v.shape[1])
        else:
            x = x / np.sqrt(v.shape[0])
        new.append(jnp.asarray(x, v.dtype))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, new))
    nnx.update(model, state)
    return model


# ---------------------------------------------------------------------------------- checks
def checked_reward(fn: Callable, step_of: Callable[[], int]) -> Callable:
    """`fn` with its output checked: one finite float per completion, else an InputError that
    names the step, the prompt and the completion."""
    name = getattr(fn, "__name__", repr(fn))

    @functools.wraps(fn)
    def reward(prompts, completions, **kw):
        step = step_of()
        try:
            out = fn(prompts, completions, **kw)
        except Exception as e:
            raise InputError(f"reward function {name!r} raised at step {step} on the batch whose "
                             f"first prompt is {str(prompts[0])!r}: {type(e).__name__}: {e}") from e
        try:
            arr = np.asarray(out, np.float64)
        except (TypeError, ValueError) as e:
            raise InputError(f"reward function {name!r} at step {step} returned "
                             f"{type(out).__name__}, not numbers (first prompt "
                             f"{str(prompts[0])!r})") from e
        if arr.shape != (len(prompts),):
            raise InputError(f"reward function {name!r} at step {step} returned shape {arr.shape} "
                             f"for {len(prompts)} completions (one reward each); first prompt "
                             f"{str(prompts[0])!r}")
        bad = np.flatnonzero(~np.isfinite(arr))
        if bad.size:
            i = int(bad[0])
            raise InputError(f"reward function {name!r} at step {step} returned {arr[i]} for "
                             f"prompt {i} {str(prompts[i])!r} (completion {completions[i]!r}); "
                             f"{bad.size} non-finite rewards in all")
        return arr.astype(np.float32)

    return reward


def mismatch_stats(rollout_lp: np.ndarray, trainer_lp: np.ndarray, mask: np.ndarray) -> dict:
    """How the rollout's logprobs of the sampled tokens differ from the trainer's.

    Over the tokens of `mask`: max and mean |Δ| (Δ = rollout - trainer), the share exactly equal,
    and KL(rollout || trainer) estimated from the rollout's own samples: k1 = mean(Δ) and
    k3 = mean(r - 1 - log r) with r = exp(-Δ) (Schulman's estimators)."""
    d = (np.asarray(rollout_lp, np.float64) - np.asarray(trainer_lp, np.float64))[np.asarray(mask, bool)]
    if d.size == 0:
        return {"tokens": 0, "max_abs": 0.0, "mean_abs": 0.0, "equal_share": 1.0, "k1": 0.0, "k3": 0.0}
    r = np.exp(-d)
    return {"tokens": int(d.size), "max_abs": float(np.abs(d).max()),
            "mean_abs": float(np.abs(d).mean()), "equal_share": float(np.mean(d == 0.0)),
            "k1": float(d.mean()), "k3": float(np.mean(r - 1.0 + d))}


def trainer_logps(model, prompt_bp: np.ndarray, completions: Sequence[np.ndarray], pad: int,
                  eos: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """The trainer's logprobs of `completions` after the left-padded prompts (Tunix's own
    `compute_per_token_logps` on the actor, as its GRPO loss computes them) and the mask of real
    completion tokens (up to the first pad id inside a completion, which Tunix masks)."""
    from flax import nnx
    from tunix.rl import common

    C = max(1, max(len(t) for t in completions))
    comp = np.full((len(completions), C), pad, np.int32)
    mask = np.zeros((len(completions), C), bool)
    for i, t in enumerate(completions):
        t = np.asarray(t, np.int32)
        n = int(np.argmax(t == pad)) if np.any(t == pad) else len(t)
        comp[i, :len(t)] = t
        mask[i, :n] = True
    graph, state = nnx.split(model)
    lp = common.compute_per_token_logps(
        graph, state, prompt_tokens=jnp.asarray(prompt_bp, jnp.int32), completion_tokens=jnp.asarray(comp),
        pad_id=pad, eos_id=eos, stop_gradient=True, return_logits=False, temperature=temperature)
    return np.asarray(lp, np.float32), mask


# ---------------------------------------------------------------------------------- the run
class GrpoRun:
    """The cluster, learner and instrumentation of one GRPO job (see the module docstring)."""

    def __init__(self, s: GrpoSettings, reward_fn: Callable | None = None,
                 actor_fn: Callable[[GrpoSettings], Any] | None = None, tokenizer: Any = None,
                 batch_fn: Callable[[GrpoSettings, int], dict] | None = None,
                 on_step: Callable[[dict], None] | None = None):
        import optax
        import orbax.checkpoint as ocp
        from flax import nnx
        from tunix.rl import rl_cluster as rl
        from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
        from tunix.rl.rollout.base_rollout import RolloutConfig

        from seer_jax.engine.engine import EngineConfig
        from seer_jax.integrations.tunix import CharTokenizer, SeerRollout

        s.validate()
        self.s = s
        self.batch_fn = batch_fn or batch_for_step
        self.on_step = on_step
        self.tokenizer = tokenizer or CharTokenizer()
        devices = jax.devices()
        actor_mesh = jax.sharding.Mesh(np.array(devices[:1]).reshape(1, 1), ("fsdp", "tp"))
        rollout_mesh = jax.sharding.Mesh(np.array(devices[1:1 + s.slices]).reshape(1, -1),
                                         ("fsdp", "tp"))
        dtype = jnp.bfloat16 if s.rollout_dtype == "bfloat16" else jnp.float32
        self.rollout_config = RolloutConfig(
            max_tokens_to_generate=s.max_tokens, temperature=s.temperature, top_p=1.0, top_k=None,
            max_prompt_length=s.max_prompt_length, return_logprobs=True, data_type=dtype,
            kv_cache_size=s.max_prompt_length + s.max_tokens + 8)
        if s.engine == "vanilla":
            engine: Any = "vanilla"
        else:
            n = s.prompts_per_step * s.group_size
            pages = 2 * n * -(-(s.max_prompt_length + s.max_tokens + 2) // 8) + 16
            engine = functools.partial(
                SeerRollout, num_instances=s.slices, tp=1, policy=s.policy,
                controller_config={"chunk_size": s.chunk_size},
                engine_config=EngineConfig(page_size=8, num_pages=pages, max_num_seqs=n,
                                           max_num_batched_tokens=max(64, n),
                                           max_model_len=s.max_prompt_length + s.max_tokens + 8,
                                           speculation=s.speculation))
        checkpoints = {}
        if s.out:
            checkpoints = dict(
                checkpoint_root_directory=str(pathlib.Path(s.out) / "tunix"),
                checkpointing_options=ocp.CheckpointManagerOptions(save_interval_steps=1,
                                                                   max_to_keep=2))
        actor = (actor_fn or tiny_actor)(s)
        self.cluster = rl.RLCluster(
            actor=actor, tokenizer=self.tokenizer,
            cluster_config=rl.ClusterConfig(
                role_to_mesh={rl.Role.ACTOR: actor_mesh, rl.Role.REFERENCE: actor_mesh,
                              rl.Role.ROLLOUT: rollout_mesh},
                rollout_engine=engine, rollout_config=self.rollout_config,
                training_config=rl.RLTrainingConfig(
                    actor_optimizer=optax.adam(s.learning_rate), eval_every_n_steps=10**9,
                    max_steps=s.steps, **checkpoints)))
        self.restored_step = self.cluster.actor_trainer.train_steps
        self.version = 0  # syncs the rollout has received (vanilla has no version of its own)
        if self.restored_step:  # the rollout was built from the initial weights: sync it
            self._sync_restored(nnx)
        self.history: list[dict] = []
        self._pending: dict = {}
        self._instrument()
        checked = checked_reward(reward_fn or addition_reward, self.trainer_step)

        def reward(prompts, completions, **kw):
            out = checked(prompts, completions, **kw)
            self._pending["rewards"] = out
            return out

        reward.__name__ = checked.__name__
        self.learner = GRPOLearner(
            rl_cluster=self.cluster, reward_fns=[reward],
            algo_config=GRPOConfig(num_generations=s.group_size, num_iterations=1, beta=0.0))

    def trainer_step(self) -> int:
        return int(self.cluster.actor_trainer.train_steps)

    def rollout_version(self) -> int:
        ro = self.cluster.rollout
        return int(ro.policy_version) if hasattr(ro, "policy_version") else self.version

    def _sync_restored(self, nnx) -> None:
        from seer_jax.integrations.tunix import SeerRollout

        ro = self.cluster.rollout
        ro.update_params(nnx.state(self.cluster.actor_trainer.model, nnx.Param), (nnx.Param,))
        self.version = self.restored_step
        if isinstance(ro, SeerRollout):
            ro.set_policy_version(self.restored_step)

    def _instrument(self) -> None:
        """Time the rollout, the train step and the sync; measure the mismatch after each rollout
        (timed apart, at the weights the rollout used); seed each step's sampling."""
        ro, cl = self.cluster.rollout, self.cluster
        gen, upd, train, sync = ro.generate, ro.update_params, cl.update_actor, cl.sync_weights
        s = self.s

        def generate(prompts, rollout_config, **kw):
            step = self.trainer_step()
            rc = dataclasses.replace(rollout_config, seed=s.seed * 100_003 + step)
            t0 = time.perf_counter()
            out = gen(prompts, rc, **kw)
            jax.block_until_ready(out.tokens)
            p = self._pending = {"step": step, "rollout_s": time.perf_counter() - t0,
                                 "policy_version": self.rollout_version(),
                                 "rollout_tokens": int(sum(len(t) for t in out.tokens))}
            if s.mismatch:
                t1 = time.perf_counter()
                lp, mask = trainer_logps(cl.actor_trainer.model, out.left_padded_prompt_tokens,
                                         out.tokens, ro.pad_id(), ro.eos_id(), s.temperature)
                rl_lp = np.zeros_like(lp)
                for i, x in enumerate(out.logprobs):
                    n = min(len(out.tokens[i]), lp.shape[1])
                    rl_lp[i, :n] = np.asarray(x, np.float32)[:n]
                p["mismatch"] = mismatch_stats(rl_lp, lp, mask)
                p["mismatch_s"] = time.perf_counter() - t1
            p["texts"] = list(out.text)
            return out

        def update_params(params, filter_types=None):
            upd(params, filter_types)
            self.version += 1

        def update_actor(*a, **kw):
            t0 = time.perf_counter()
            r = train(*a, **kw)
            jax.block_until_ready(jax.tree.leaves(nnx_params(cl.actor_trainer.model)))
            self._pending["train_s"] = time.perf_counter() - t0
            return r

        def sync_weights():
            t0 = time.perf_counter()
            sync()
            self._pending["sync_s"] = time.perf_counter() - t0
            self._pending["version_after_sync"] = self.rollout_version()
            self._pending["trainer_step_after_sync"] = self.trainer_step()
            self._record()

        ro.generate, ro.update_params = generate, update_params
        cl.update_actor, cl.sync_weights = update_actor, sync_weights

    def _record(self) -> None:
        p = self._pending
        texts = p.pop("texts")
        rewards = [float(x) for x in p.pop("rewards", [])]
        wall = (self.history[-1]["wall_s"] if self.history else 0.0) + sum(
            p.get(k, 0.0) for k in ("rollout_s", "train_s", "sync_s"))
        p.update(mean_reward=float(np.mean(rewards)) if rewards else None,
                 exact=float(np.mean([r >= 1.0 for r in rewards])) if rewards else None,
                 tokens_per_s=p["rollout_tokens"] / max(p["rollout_s"], 1e-9), wall_s=wall,
                 sample=texts[0][:16])
        self.history.append(p)
        self._pending = {}
        if self.on_step is not None:
            self.on_step(p)

    def train(self) -> None:
        first, s = self.restored_step, self.s
        if first >= s.steps:
            return
        try:
            # all the batches: on resume Tunix skips those of the restored steps itself
            self.learner.train([self.batch_fn(s, k) for k in range(s.steps)])
        except BaseException:
            # Tunix closes the trainer only when training ends; on an error close it here, which
            # saves the last step's checkpoint and waits for pending writes
            self.cluster.close()
            raise

    def report(self) -> dict:
        h, s = self.history, self.s
        steady = h[1:] if len(h) > 1 else h

        def med(key):
            vals = [x[key] for x in steady if x.get(key) is not None]
            return float(np.median(vals)) if vals else None

        rewards = [x["mean_reward"] for x in h if x["mean_reward"] is not None]
        k = max(1, len(rewards) // 5)
        mm = [x["mismatch"] for x in h if "mismatch" in x]
        summary = {
            "engine": s.engine, "slices": s.slices, "rollout_dtype": s.rollout_dtype,
            "seed": s.seed, "steps_run": len(h), "first_step": h[0]["step"] if h else None,
            "responses_per_step": s.prompts_per_step * s.group_size,
            "reward_first": float(np.mean(rewards[:k])) if rewards else None,
            "reward_last": float(np.mean(rewards[-k:])) if rewards else None,
            "rollout_s_median": med("rollout_s"), "train_s_median": med("train_s"),
            "sync_s_median": med("sync_s"), "tokens_per_s_median": med("tokens_per_s"),
            "iteration_s_median": (med("rollout_s") or 0) + (med("train_s") or 0) + (med("sync_s") or 0),
            "wall_s": h[-1]["wall_s"] if h else 0.0,
            "versions_match": all(x["policy_version"] == x["step"]
                                  and x["version_after_sync"] == x["trainer_step_after_sync"] for x in h),
            "final_policy_version": self.rollout_version(), "trainer_steps": self.trainer_step(),
        }
        if mm:
            summary["mismatch"] = {
                "max_abs": max(m["max_abs"] for m in mm),
                "mean_abs": float(np.mean([m["mean_abs"] for m in mm])),
                "equal_share": float(np.mean([m["equal_share"] for m in mm])),
                "k1": float(np.mean([m["k1"] for m in mm])), "k3": float(np.mean([m["k3"] for m in mm])),
                "tokens": int(sum(m["tokens"] for m in mm))}
        return {"summary": summary, "settings": dataclasses.asdict(s), "steps": h}


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def run_grpo(s: GrpoSettings, reward_fn: Callable | None = None, **kw) -> dict:
    """Build, train (resuming from s.out when it holds checkpoints) and report one GRPO job."""
    run = GrpoRun(s, reward_fn, **kw)
    run.train()
    return run.report()
