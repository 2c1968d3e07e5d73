"""End-to-end tail of a grouped rollout with and without grouped speculative decoding.

For every group of a recorded rollout (JSONL from `benchmarks/drafting.py --save-rollouts`, or
generated here with SmolLM2 at temperature 1.0), the first G-k responses are finished siblings:
their tokens are in the group draft context. The last k requests resume from the first 75% of
their recorded response and decode the rest greedily on the real engine, once without and once
with speculation (drafts from the group context, adaptive budget). Tokens must be identical.
Reports engine steps, measured wall time on this host, and modelled time on an accelerator
(roofline cost model of each executed step), and writes JSON.

    python benchmarks/spec_tail.py --rollouts /tmp/natural.jsonl --json /tmp/spec_tail.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from seer_jax.provenance import run_info


def load_groups(path, num_groups):
    groups = []
    with open(path) as f:
        for line in f:
            g = json.loads(line)
            groups.append((str(g["group_id"]), list(g["prompt_ids"]), [list(r) for r in g["responses"]]))
    return groups[:num_groups]


def generate_groups(cfg, params, tok, num_groups, group_size, max_tokens, mix):
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.rollout.core.prompts import prompt_set
    from seer_jax.rollout.core.types import SamplingParams

    items = prompt_set(mix)[:num_groups]
    eng = Engine(cfg, params, EngineConfig(kv_memory_gib=1.0, max_num_seqs=64))
    prompts = [tok.encode_chat(it.messages or [{"role": "user", "content": it.text}]) for it in items]
    for g, p in enumerate(prompts):
        for j in range(group_size):
            eng.add_request(f"{g}/{j}", p, max_tokens, SamplingParams(temperature=1.0, seed=1000 * g + j))
    out = eng.run_until_done()
    return [(str(g), p, [out[f"{g}/{j}"].token_ids for j in range(group_size)]) for g, p in enumerate(prompts)]


def run_tail(cfg, params, groups, k, speculation, cost):
    from seer_jax.drafting.service import InProcessDraftService
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.engine.speculation import Speculator
    from seer_jax.rollout.core.types import SamplingParams

    spec = None
    if speculation:
        service = InProcessDraftService()
        spec = Speculator(service)
    eng = Engine(cfg, params, EngineConfig(kv_memory_gib=1.0, max_num_seqs=64, speculation=speculation),
                 speculator=spec)
    n_req = 0
    for gid, prompt, responses in groups:
        if spec is not None:
            spec.service.append(gid, None, prompt)
            for j, r in enumerate(responses[:-k]):
                spec.service.append(gid, f"{gid}/{j}", r)
        for j in range(len(responses) - k, len(responses)):
            r = responses[j]
            cut = (3 * len(r)) // 4
            if len(r) - cut < 2:
                continue
            if spec is not None:
                spec.service.append(gid, f"{gid}/{j}", r[:cut])
            eng.add_request(f"{gid}/{j}", prompt, len(r) - cut, SamplingParams(temperature=0.0),
                            output_ids=r[:cut], group_id=gid)
            n_req += 1
    t0 = time.perf_counter()
    out = eng.run_until_done()
    wall = time.perf_counter() - t0
    modelled = sum(cost.step_time(s.batch_size, s.num_prefill_tokens, s.num_decode_tokens, s.kv_tokens)
                   for s in eng.step_stats)
    tokens = {rid: r.token_ids for rid, r in out.items()}
    return {"requests": n_req, "steps": eng.step_count, "wall_s": wall, "modelled_s": modelled,
            "output_tokens": sum(len(t) for t in tokens.values()),
            "spec_proposed": spec.proposed if spec else 0, "spec_accepted": spec.accepted if spec else 0,
            "spec_steps": spec.spec_steps if spec else 0}, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", default=None, help="JSONL of grouped rollouts")
    p.add_argument("--generate", default=None, help="prompt mix to generate (natural|structured)")
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tail-requests", type=int, default=2, help="unfinished requests per group")
    p.add_argument("--accelerator", default="h100")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    from seer_jax.costs import RooflineCostModel, get_accelerator, get_model
    from seer_jax.model import load

    cfg, params, tok = load("smollm2")
    if args.rollouts:
        groups = load_groups(args.rollouts, args.num_groups)
    else:
        groups = generate_groups(cfg, params, tok, args.num_groups, args.group_size, args.max_tokens,
                                 args.generate or "natural")
    cost = RooflineCostModel(model=get_model("smollm2-135m"), accelerator=get_accelerator(args.accelerator))
    run_tail(cfg, params, groups[:1], args.tail_requests, False, cost)  # warm-up (compiles)
    run_tail(cfg, params, groups[:1], args.tail_requests, True, cost)
    base, base_tok = run_tail(cfg, params, groups, args.tail_requests, False, cost)
    spec, spec_tok = run_tail(cfg, params, groups, args.tail_requests, True, cost)
    identical = base_tok == spec_tok
    summary = {
        "tokens_identical": identical,
        "accepted_per_spec_step": spec["spec_accepted"] / max(spec["spec_steps"], 1),
        "step_ratio_vs_no_spec": spec["steps"] / base["steps"],
        "tail_speedup": base["modelled_s"] / spec["modelled_s"],
        "tail_speedup_measured_cpu": base["wall_s"] / spec["wall_s"],
        "accelerator": args.accelerator,
    }
    print(f"{'':14s}{'steps':>8s}{'wall s':>10s}{'modelled s':>12s}{'accepted':>10s}")
    for name, r in (("no spec", base), ("grouped spec", spec)):
        print(f"{name:14s}{r['steps']:8d}{r['wall_s']:10.2f}{r['modelled_s']:12.4f}{r['spec_accepted']:10d}")
    print(json.dumps(summary, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"summary": summary, "no_spec": base, "spec": spec, "args": vars(args),
                       "run": run_info()}, f, indent=1)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
