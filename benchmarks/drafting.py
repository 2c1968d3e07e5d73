"""Grouped speculative drafting: replay study and modelled tail speedup.

(a) Replay: each group's recorded responses are replayed as if generated concurrently (lock-step,
    optionally staggered starts); at every step every request gets a draft, which is checked
    against the recorded continuation (tree: longest matching root-to-node path). Reports mean
    accepted draft tokens per speculation (a step with a non-empty draft) and per step (including
    the bonus token) for:
      per_request      our suffix automaton over the request's prompt + own output, chains of ≤ γ
      per_request_multipath  the same context, trees (top-k at forks, node budget)
      group            our group context (prompt + every sibling; with own_context also the
                       request's own automaton), chains of ≤ γ tokens
      group_multipath  the group context, trees
    Both modes get the same drafting knobs (--min-prob, --prior, --match-candidates, ...).
      arctic_per_request / arctic   arctic-inference's SuffixDecodingCache (own context /
                       siblings' active responses added), when importable.
(b) Modelled tail: the last quarter of every response, all requests of all groups in one batch
    (shrinking as responses end), with and without speculation under the adaptive budget
    (T(B, γ) from --profile or the default cost model). Tokens are the recorded ones either way,
    so the comparison is steps and modelled time to finish.

Rollouts: --rollouts FILE.jsonl ({"group_id", "prompt_ids", "responses"} per line), or
--texts FILE.jsonl ({"prompt", "responses": [str, ...]} per line, tokenized with SmolLM2's
tokenizer; --max-tokens-per-response caps each response), or
--generate (SmolLM2-135M-Instruct at temperature 1.0 on the built-in prompt mixes, slow on CPU;
--save-rollouts keeps them), or --synthetic MIX[,MIX] (a template/Markov source, default).

--calibration-out FILE writes the per-position acceptance of the chain modes (own context vs
group context, by finished siblings; seer_jax.drafting.calibration) for
`seer-jax simulate --config.spec.calibration=FILE`.

  python benchmarks/drafting.py --synthetic natural,structured --json /tmp/drafting.json
  python benchmarks/drafting.py --texts TEXTS.jsonl --json report.json --calibration-out cal.json
  python benchmarks/drafting.py --generate natural --num-groups 16 --response-len 256 \\
      --save-rollouts /tmp/natural.jsonl --json /tmp/drafting_natural.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from seer_jax.analysis.drafting_replay import (
    RATES,
    ArcticDrafter,
    CopyOracleDrafter,
    OursDrafter,
    load_rollouts_jsonl,
    replay,
    save_rollouts_jsonl,
    simulate_tail,
)
from seer_jax.analysis.synthetic_text import synthetic_groups
from seer_jax.drafting import BudgetConfig, DraftConfig, SpeculationBudget
from seer_jax.drafting.calibration import build_calibration, write_calibration


def generate_rollouts(mix: str, num_groups: int, group_size: int, max_tokens: int, seed: int,
                      kv_memory_gib: float = 0.5):
    """Sample G responses per prompt with SmolLM2 on the paged engine (temperature 1.0; the same
    tokens as the reference generator with these seeds, but it stops at EOS)."""
    from seer_jax.analysis.drafting_replay import GroupRollout
    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.model import load
    from seer_jax.rollout.core.prompts import prompt_set
    from seer_jax.rollout.core.types import SamplingParams

    cfg, params, tok = load("smollm2")
    items = prompt_set(mix)[:num_groups]
    prompts = [tok.encode_chat([{"role": "user", "content": it.text}]) for it in items]
    flat = [p for p in prompts for _ in range(group_size)]
    sampling = [SamplingParams(temperature=1.0, seed=seed * 1_000_003 + i) for i in range(len(flat))]
    eos = tuple(cfg.eos_token_ids) or ((tok.eos_id,) if tok.eos_id is not None else ())
    t0 = time.perf_counter()
    engine = Engine(cfg, params, EngineConfig(kv_memory_gib=kv_memory_gib, max_num_seqs=64), eos_ids=eos)
    for i, (p, sp) in enumerate(zip(flat, sampling, strict=True)):
        engine.add_request(str(i), p, max_tokens, sp)
    done = engine.run_until_done()
    gens = [done[str(i)] for i in range(len(flat))]
    print(f"generated {len(gens)} responses in {time.perf_counter() - t0:.0f}s", flush=True)
    groups = []
    for g, p in enumerate(prompts):
        resp = [gens[g * group_size + i].token_ids for i in range(group_size)]
        groups.append(GroupRollout(group_id=f"{mix}-{g}", prompt_ids=list(p), responses=resp))
    return groups


def draft_config(args, mode: str = "group") -> DraftConfig:
    """The drafting knobs of the command line; per-request mode gets the same ones (own_context
    only means something in group mode: per-request mode drafts from its own text alone)."""
    return DraftConfig(mode=mode, max_match_len=args.max_match_len, min_prob=args.min_prob,
                       max_spec_factor=args.max_spec_factor, match_candidates=args.match_candidates,
                       prior=args.prior, own_context=args.own_context, merge_trees=args.merge_trees)


def run_modes(groups, args, keep: dict | None = None) -> dict[str, dict]:
    """Replay every mode; `keep` (if given) receives each mode's ReplayStats by name."""
    per = draft_config(args, "per_request")
    grp = draft_config(args, "group")
    modes = {
        "per_request": OursDrafter.factory(per, args.gamma, args.gamma),
        "per_request_multipath": OursDrafter.factory(per, args.tree_nodes, args.gamma,
                                                     args.tree_width),
        "group": OursDrafter.factory(grp, args.gamma, args.gamma),
        "group_multipath": OursDrafter.factory(grp, args.tree_nodes, args.gamma, args.tree_width),
    }
    if not args.no_arctic and ArcticDrafter.available():
        kw = dict(max_spec_tokens=args.gamma, min_token_prob=args.min_prob,
                  max_spec_factor=args.arctic_spec_factor)
        modes["arctic_per_request"] = lambda g: ArcticDrafter(g, siblings=False, **kw)
        modes["arctic"] = lambda g: ArcticDrafter(g, siblings=True, **kw)
    out = {}
    for name, make in modes.items():
        t0 = time.perf_counter()
        stats = replay(groups, make, stagger=args.stagger, seed=args.seed)
        out[name] = stats.summary()
        print(f"  {name}: {stats.steps} steps in {time.perf_counter() - t0:.0f}s", flush=True)
        if keep is not None:
            keep[name] = stats
    return out


def arctic_status(args) -> str | None:
    """Why the arctic-inference columns are missing (None when they run)."""
    if args.no_arctic:
        return "skipped: --no-arctic"
    if not ArcticDrafter.available():
        return "skipped: arctic_inference is not installed (arctic_inference.suffix_decoding " \
               "is not importable)"
    return None


def provenance(argv) -> dict:
    """Command (file paths reduced to their names), commit and versions."""
    import os
    import platform
    import subprocess

    import numpy as np

    def short(a: str) -> str:
        return os.path.basename(a) if os.sep in a and os.path.exists(a) else a

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                    cwd=root, capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", None
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import tokenizers

        versions["tokenizers"] = tokenizers.__version__
    except ImportError:
        pass
    return {"command": " ".join(["python benchmarks/drafting.py", *map(short, argv)]),
            "commit": commit, "uncommitted_changes": dirty, "versions": versions}


GROUP_MODES = ("group", "group_multipath")
PER_REQUEST_MODES = ("per_request", "per_request_multipath")


def drafted_per_step(summary: dict) -> float:
    """Accepted draft tokens per step, the bonus token left out."""
    return summary["accepted_per_step"] - 1.0


def best_group_ratio(values: dict) -> float:
    """Best group mode over best per-request mode (chain or tree on each side)."""
    return (max(values[k] for k in GROUP_MODES)
            / max(*(values[k] for k in PER_REQUEST_MODES), 1e-9))


def run_bounds(groups, args) -> dict[str, dict]:
    """The copy bound (`CopyOracleDrafter`) of the request's own context and of the group's, on
    the same replay: what any copy-based drafter could get accepted at most, per step."""
    kw = dict(depth=args.gamma, match_len=args.copy_match_len)
    return {
        name: replay(groups, lambda g, sib=sib: CopyOracleDrafter(g, sib, **kw),
                     stagger=args.stagger, seed=args.seed).summary()
        for name, sib in (("per_request", False), ("group", True))
    }


def print_table(title: str, res: dict[str, dict]) -> None:
    print(f"\n[{title}]")
    print(f"{'mode':<22} {'acc/spec':>9} {'acc/step':>9} {'draft/spec':>10} {'accept%':>8} "
          f"{'spec%':>6} {'tail acc/step':>13} {'us/spec':>8}")
    for name, s in res.items():
        print(f"{name:<22} {s['accepted_per_spec']:>9.3f} {s['accepted_per_step']:>9.3f} "
              f"{s['draft_tokens_per_spec']:>10.2f} {100 * s['acceptance_rate']:>7.1f}% "
              f"{100 * s['spec_fraction']:>5.1f}% {s['accepted_per_step_by_quarter'][3]:>13.3f} "
              f"{s['us_per_speculate']:>8.1f}")
    rates = list(next(iter(res.values()))["accepted_per_spec_at_rate"])
    print("accepted/spec when speculating on the top share of steps by the drafter's own score:")
    print(f"{'mode':<22} " + " ".join(f"{'top ' + r:>9}" for r in rates))
    for name, s in res.items():
        vals = s["accepted_per_spec_at_rate"]
        print(f"{name:<22} " + " ".join(
            f"{'-':>9}" if vals[r] is None else f"{vals[r]:>9.3f}" for r in rates))


def print_calibration(cal: dict) -> None:
    print("\n[per-position acceptance: P(position j accepted | positions < j were), over every "
          "step (per_step) and over drafts offering position j (offered)]")
    print(f"{'context':<22} {'steps':>8}  " + " ".join(f"{'j=' + str(j + 1):>6}"
                                                   for j in range(cal["gamma_max"])))
    rows = [("solo per_step", cal["solo"], "per_step"), ("solo offered", cal["solo"], "offered"),
            ("group per_step", cal["group"], "per_step"),
            ("group offered", cal["group"], "offered")]
    gb = cal["group_by_finished"]
    for (lo, hi), r in zip(gb["buckets"], gb["rates"], strict=True):
        label = f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"
        rows.append((f"group, {label} finished", r, "per_step"))
    for label, r, key in rows:
        print(f"{label:<22} {r['steps']:>8}  " + " ".join(f"{x:>6.3f}" for x in r[key]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--rollouts", action="append", help="grouped rollouts JSONL (repeatable)")
    src.add_argument("--generate", help="prompt mixes to sample with SmolLM2, e.g. natural,structured")
    src.add_argument("--synthetic", default="natural,structured", help="synthetic mixes")
    src.add_argument("--texts", help="response texts JSONL ({\"prompt\", \"responses\": [str]} "
                     "per line), tokenized with SmolLM2's tokenizer; the report holds no text")
    ap.add_argument("--max-tokens-per-response", type=int, default=0,
                    help="--texts: keep only this many leading tokens of each response (0: all)")
    ap.add_argument("--calibration-out", help="write the measured per-position acceptance "
                    "(own context vs group context, by finished siblings) here, for "
                    "seer-jax simulate --config.spec.calibration")
    ap.add_argument("--no-tail", action="store_true", help="skip the modelled tail")
    ap.add_argument("--save-rollouts", help="write generated/synthetic rollouts here (one mix: "
                    "PATH; several: PATH gets -MIX before the suffix)")
    ap.add_argument("--num-groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--kv-memory-gib", type=float, default=0.5, help="--generate: engine KV pool")
    ap.add_argument("--gamma", type=int, default=8, help="max draft length (chains, tree depth)")
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--tree-width", type=int, default=4)
    ap.add_argument("--max-match-len", type=int, default=64)
    d = DraftConfig()
    ap.add_argument("--min-prob", type=float, default=d.min_prob)
    ap.add_argument("--match-candidates", type=int, default=d.match_candidates,
                    help="ours: draft from this many match lengths (best score / merged trees)")
    ap.add_argument("--prior", type=float, default=d.prior,
                    help="ours: pseudo-count in each step's probability count / (total + prior)")
    ap.add_argument("--own-context", action=argparse.BooleanOptionalAction, default=d.own_context,
                    help="ours, group modes: also draft from the request's own text")
    ap.add_argument("--merge-trees", action=argparse.BooleanOptionalAction, default=d.merge_trees,
                    help="ours, trees: merge every candidate's tree instead of the best one")
    ap.add_argument("--max-spec-factor", type=float, default=None,
                    help="ours: cap draft depth at factor x match length (default: no cap)")
    ap.add_argument("--arctic-spec-factor", type=float, default=1.0,
                    help="arctic's max_spec_factor (its default 1.0)")
    ap.add_argument("--copy-match-len", type=int, default=1,
                    help="copy bound: the continuation must follow the request's last N tokens")
    ap.add_argument("--stagger", type=int, default=0, help="max random start offset (steps)")
    ap.add_argument("--no-arctic", action="store_true")
    ap.add_argument("--profile", help="step-time profile JSON for the tail model")
    ap.add_argument("--tail-fraction", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    prov = provenance(sys.argv[1:] if argv is None else argv)

    datasets: dict[str, list] = {}
    if args.texts:
        import os

        from seer_jax.analysis.drafting_replay import load_texts_jsonl
        from seer_jax.model.hub import resolve_model
        from seer_jax.model.tokenizer import Tokenizer

        tok = Tokenizer.load(resolve_model("smollm2"))
        datasets[os.path.basename(args.texts)] = load_texts_jsonl(
            args.texts, tok, args.max_tokens_per_response)
        if args.max_tokens_per_response:
            print(f"responses capped at their first {args.max_tokens_per_response:,} tokens "
                  "(--max-tokens-per-response)")
    elif args.rollouts:
        for path in args.rollouts:
            datasets[path] = load_rollouts_jsonl(path)
    elif args.generate:
        for mix in args.generate.split(","):
            datasets[mix] = generate_rollouts(mix, args.num_groups, args.group_size,
                                              args.response_len, args.seed, args.kv_memory_gib)
    else:
        for mix in args.synthetic.split(","):
            datasets[f"synthetic-{mix}"] = synthetic_groups(
                args.num_groups, args.group_size, args.response_len, mix=mix, seed=args.seed)
    if args.save_rollouts and not (args.rollouts or args.texts):
        for name, groups in datasets.items():
            path = args.save_rollouts
            if len(datasets) > 1:
                stem, dot, ext = path.rpartition(".")
                path = f"{stem}-{name}.{ext}" if dot else f"{path}-{name}"
            save_rollouts_jsonl(path, groups)
            print(f"saved {path}")

    config = dict(vars(args))
    for key in ("texts", "rollouts", "profile", "json", "calibration_out", "save_rollouts"):
        v = config.get(key)
        if v:  # file names only: no local paths in a committed report
            config[key] = ([pathlib.Path(x).name for x in v] if isinstance(v, list)
                           else pathlib.Path(v).name)
    report = {"provenance": prov, "config": config, "datasets": {}}
    arctic = arctic_status(args)
    if arctic:
        report["arctic_inference"] = arctic
        print(f"arctic-inference columns {arctic}")
    calib_src = None
    for name, groups in datasets.items():
        kept: dict = {}
        res = run_modes(groups, args, kept)
        if calib_src is None:
            calib_src = (name, groups, kept)
        bounds = run_bounds(groups, args)
        n_tok = sum(len(r) for g in groups for r in g.responses)
        report["datasets"][name] = {"groups": len(groups), "responses": sum(len(g.responses) for g in groups),
                                    "tokens": n_tok,
                                    "prompt_tokens_mean": float(np.mean([len(g.prompt_ids)
                                                                         for g in groups])),
                                    "modes": res, "copy_bound": bounds}
        if not args.no_tail:
            budget = SpeculationBudget.from_profile_json(args.profile,
                                                         BudgetConfig(gamma_max=args.gamma))
            report["datasets"][name]["tail"] = simulate_tail(
                groups, budget, draft_config(args), tail_fraction=args.tail_fraction)
        print_table(f"{name}: {len(groups)} groups, {n_tok} tokens", res)
        cb = {k: drafted_per_step(v) for k, v in bounds.items()}
        print(f"copy bound (best occurrence in hindsight, after the last {args.copy_match_len} "
              f"token(s)), accepted draft tokens/step: own context {cb['per_request']:.3f}, "
              f"group context {cb['group']:.3f} ({cb['group'] / max(cb['per_request'], 1e-9):.2f}x)")
        if args.no_tail:
            continue
        tail = report["datasets"][name]["tail"]
        print(f"tail ({args.tail_fraction:.0%} of each response, all requests in one batch): "
              f"steps {tail['steps_spec']} vs {tail['steps_plain']} plain, modelled time "
              f"{tail['time_spec_s']:.3f}s vs {tail['time_plain_s']:.3f}s -> speedup "
              f"{tail['tail_speedup']:.2f}x (accepted/spec {tail['accepted_per_spec']:.2f})")

    first = next(iter(report["datasets"].values()))
    def summarize(d):
        m = d["modes"]
        s = {
            "accepted_per_spec": {k: v["accepted_per_spec"] for k, v in m.items()},
            "accepted_per_step": {k: v["accepted_per_step"] for k, v in m.items()},
            "tail_speedup": d["tail"]["tail_speedup"] if "tail" in d else None,
        }
        # each side at its best: group chain or tree vs per-request chain or tree
        per_spec = s["accepted_per_spec"]
        best_group = max(per_spec[k] for k in GROUP_MODES)
        s["best_group_accepted_per_spec_ratio_vs_per_request"] = best_group_ratio(per_spec)
        s["best_group_accepted_per_spec_minus_per_request"] = (
            best_group - max(per_spec[k] for k in PER_REQUEST_MODES))
        # accepted draft tokens per step, same comparison
        s["best_group_accepted_draft_per_step_ratio_vs_per_request"] = best_group_ratio(
            {k: drafted_per_step(m[k]) for k in GROUP_MODES + PER_REQUEST_MODES})
        # at equal speculation rates (each drafter keeps the steps it scores highest)
        s["best_group_accepted_per_spec_ratio_vs_per_request_at_rate"] = {
            r: best_group_ratio({k: m[k]["accepted_per_spec_at_rate"][r] or 0.0
                                 for k in GROUP_MODES + PER_REQUEST_MODES})
            for r in (f"{x:g}" for x in RATES)}
        cb = {k: drafted_per_step(v) for k, v in d["copy_bound"].items()}
        s["copy_bound_accepted_draft_per_step"] = cb
        s["copy_bound_group_ratio_vs_per_request"] = cb["group"] / max(cb["per_request"], 1e-9)
        if "arctic" in m:
            s["best_group_accepted_per_spec_ratio_vs_arctic"] = (
                best_group / max(m["arctic"]["accepted_per_spec"], 1e-9))
        return s
    report["summary"] = {**summarize(first),
                         "by_dataset": {k: summarize(v) for k, v in report["datasets"].items()}}
    for name, s in report["summary"]["by_dataset"].items():
        print(f"{name}: best group vs best per-request, accepted/spec "
              f"{s['best_group_accepted_per_spec_ratio_vs_per_request']:.2f}x "
              f"({s['best_group_accepted_per_spec_minus_per_request']:+.3f}), accepted draft "
              f"tokens/step {s['best_group_accepted_draft_per_step_ratio_vs_per_request']:.2f}x")
    if args.calibration_out:
        name, groups, kept = calib_src
        solo, grp = kept["per_request"], kept["group"]
        source = {"dataset": name, "groups": len(groups),
                  "responses": sum(len(g.responses) for g in groups),
                  "tokens": sum(len(r) for g in groups for r in g.responses),
                  "tokenizer": "smollm2" if args.texts else None,
                  "max_tokens_per_response": args.max_tokens_per_response or None,
                  "solo_mode": "per_request (chains, own context)",
                  "group_mode": "group (chains, group context)",
                  "stagger": args.stagger, **prov}
        cal = build_calibration((solo.depths, solo.accepts),
                                (grp.depths, grp.accepts, grp.finished), args.gamma,
                                source=source)
        write_calibration(args.calibration_out, cal)
        report["calibration"] = {k: cal[k] for k in ("solo", "group", "group_by_finished")}
        print_calibration(cal)
        print(f"wrote {args.calibration_out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
