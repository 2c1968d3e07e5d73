"""Are the rollout's logprobs the trainer's? The logprobs seer_jax's engines report for the tokens
they sampled, against the trainer's own forward over the same tokens, through each rollout
mechanism: a whole rollout on one engine, divided rollout (short chunks, placement forced to
migrate chunks between two engines, the KV moving through the pool), and grouped speculative
decoding; with the rollout's weights in float32 and in bfloat16 (the trainer stays float32).

    python benchmarks/onpolicy.py [--model tiny] [--groups 4] [--group-size 8] [--max-tokens 24]
        [--json benchmarks/results/onpolicy.json]

The trainer's forward is `seer_jax.integrations.nnx_actor.completion_logprobs`: one pass over
the left-padded prompt and the completion with no KV cache, as `TunixLlama` (the actor of a Tunix
job on our model) computes it, under the sampling distribution (temperature). Per mode: max and
mean |Δ| (Δ = rollout - trainer logprob of each sampled token), the share exactly equal, and the
k1/k3 estimates of KL(rollout || trainer), next to what the mechanism did (chunks, migrations,
re-prefilled tokens, drafts proposed and accepted). `--model` takes anything
`seer_jax.model.load` reads (a checkpoint path, "smollm2") as well as "tiny" (a random Llama over
128 ids), so a mixture-of-experts model is measured the same way once the model code serves it.

JSON: `run` (command, commit, versions), `summary` (per dtype and mode the mismatch and the
mechanism's counters).
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
sys.path.insert(0, str(ROOT))

# name: (engines, controller config, speculation)
MODES = {
    "whole": (1, {}, False),
    "divided_migrating": (2, {"chunk_size": 4, "balance_threshold": 0}, False),
    "grouped_speculation": (1, {}, True),
}


def load_model(name: str, seed: int, logit_scale: float):
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params

    if name == "tiny":
        cfg = tiny_config(vocab_size=128, eos_token_ids=(2,))
        params = init_params(cfg, seed)
        return cfg, {**params, "lm_head": params["lm_head"] * logit_scale}
    from seer_jax.model import load

    cfg, params, _ = load(name)
    return cfg, params


def prompts_for(cfg, groups: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    lo = 3 if cfg.vocab_size > 8 else 0
    return [rng.integers(lo, cfg.vocab_size, int(rng.integers(6, 14))).tolist() for _ in range(groups)]


def rollout(cfg, params, dtype: str, mode: str, prompts, group_size: int, max_tokens: int,
            temperature: float, seed: int):
    import jax

    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.integrations.engine_group import slice_meshes
    from seer_jax.integrations.weight_sync import reshard_params
    from seer_jax.rollout.api import rollout_groups
    from seer_jax.rollout.backends.engine_instance import EngineInstance
    from seer_jax.rollout.backends.kv_pool import HostKVPool
    from seer_jax.rollout.core.types import SamplingParams

    n_engines, controller, speculation = MODES[mode]
    rcfg = cfg.with_dtype(dtype)
    n = len(prompts) * group_size
    longest = max(len(p) for p in prompts) + max_tokens
    ec = EngineConfig(page_size=8, num_pages=2 * n * (-(-longest // 8) + 1) + 16, max_num_seqs=n,
                      max_num_batched_tokens=max(64, n), max_model_len=longest + 8,
                      speculation=speculation)
    pool = HostKVPool()
    instances = []
    for i, mesh in enumerate(slice_meshes(jax.devices()[:n_engines], n_engines, 1)):
        engine = Engine(rcfg, reshard_params(params, mesh, rcfg), ec, mesh=mesh,
                        eos_ids=tuple(cfg.eos_token_ids) or None)
        instances.append(EngineInstance(i, engine, pool))
    t0 = time.perf_counter()
    out = rollout_groups(instances, prompts, group_size, max_tokens,
                         SamplingParams(temperature=temperature, seed=seed), policy="seer",
                         config={"chunk_size": max_tokens, **controller})
    return out, time.perf_counter() - t0


def trainer_logprobs(cfg, params, results, temperature: float, pad: int):
    """The trainer's logprobs of every result's tokens: one forward, prompts left-padded."""
    import jax.numpy as jnp
    import numpy as np

    from seer_jax.integrations.nnx_actor import completion_logprobs

    P = max(len(r.prompt_ids) for r in results)
    C = max(1, max(len(r.token_ids) for r in results))
    B = len(results)
    prompt = np.full((B, P), pad, np.int32)
    comp = np.full((B, C), pad, np.int32)
    valid = np.zeros((B, P + C), bool)
    mask = np.zeros((B, C), bool)
    for i, r in enumerate(results):
        prompt[i, P - len(r.prompt_ids):] = r.prompt_ids
        valid[i, P - len(r.prompt_ids):P] = True
        comp[i, :len(r.token_ids)] = r.token_ids
        valid[i, P:P + len(r.token_ids)] = True
        mask[i, :len(r.token_ids)] = True
    lp = completion_logprobs(params, cfg, jnp.asarray(prompt), jnp.asarray(comp), jnp.asarray(valid),
                             jnp.full((B,), temperature, jnp.float32), jnp.ones((B,), jnp.float32),
                             jnp.zeros((B,), jnp.int32))
    rollout_lp = np.zeros((B, C), np.float32)
    for i, r in enumerate(results):
        rollout_lp[i, :len(r.logprobs)] = r.logprobs
    return rollout_lp, np.asarray(lp, np.float32), mask


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="'tiny' or anything seer_jax.model.load reads")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {list(MODES)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logit-scale", type=float, default=8.0,
                    help="tiny: output weights scaled so next-token distributions are peaked as a "
                         "trained model's are (a group's samples then share text to draft from)")
    ap.add_argument("--json", default="benchmarks/results/onpolicy.json")
    args = ap.parse_args(argv)
    import jax
    import numpy as np

    from seer_jax.integrations.tunix_grpo import mismatch_stats
    from seer_jax.provenance import run_info

    info = run_info()
    cfg, params = load_model(args.model, args.seed, args.logit_scale)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    prompts = prompts_for(cfg, args.groups, args.seed)
    summary: dict = {"model": args.model, "logit_scale": args.logit_scale if args.model == "tiny" else None, "groups": args.groups, "group_size": args.group_size,
                     "max_tokens": args.max_tokens, "temperature": args.temperature,
                     "trainer": "float32, nnx_actor.completion_logprobs (full sequence, no KV cache)",
                     "modes": {}}
    print(f"{'dtype':9s} {'mode':20s} {'tokens':>6s} {'max|d|':>9s} {'mean|d|':>9s} {'equal':>6s} "
          f"{'k1':>10s} {'k3':>9s} {'migr':>5s} {'reprefill':>9s} {'spec acc/prop':>13s} {'same tokens':>11s}")
    for dtype in args.dtypes.split(","):
        base_tokens = None
        for mode in args.modes.split(","):
            out, seconds = rollout(cfg, params, dtype, mode, prompts, args.group_size,
                                   args.max_tokens, args.temperature, args.seed)
            rl, tr, mask = trainer_logprobs(cfg, params, out.results, args.temperature, pad=0)
            m = mismatch_stats(rl, tr, mask)
            rep = out.report
            tokens = [tuple(r.token_ids) for r in sorted(out.results, key=lambda r: (r.group_index, r.sample_index))]
            base_tokens = base_tokens or tokens
            row = {**m, "chunks": rep.chunks, "migrations": rep.migrations,
                   "reprefill_tokens": rep.reprefill_tokens, "spec_proposed": rep.spec_proposed,
                   "spec_accepted": rep.spec_accepted, "rollout_s": seconds,
                   "responses_equal_to_whole": float(np.mean([a == b for a, b in zip(tokens, base_tokens, strict=True)]))}
            summary["modes"].setdefault(dtype, {})[mode] = row
            print(f"{dtype:9s} {mode:20s} {m['tokens']:6d} {m['max_abs']:9.2e} {m['mean_abs']:9.2e} "
                  f"{m['equal_share']:6.3f} {m['k1']:10.2e} {m['k3']:9.2e} {rep.migrations:5d} "
                  f"{rep.reprefill_tokens:9d} {rep.spec_accepted:>6d}/{rep.spec_proposed:<6d} "
                  f"{row['responses_equal_to_whole']:11.3f}", flush=True)
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run": info, "summary": summary}, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
