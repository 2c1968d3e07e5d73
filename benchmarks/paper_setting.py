"""The simulator at Seer's published settings: seer against the veRL-style baseline
(`group_round_robin`: whole groups pinned round-robin to instances, no division) beside the
paper's reported gains.

Seer (arXiv 2511.14617) ran on H800 GPUs: Moonlight-16B-A3B on 32 GPUs (400 prompts x 8
samples, up to 65,536 tokens), Qwen2-VL-72B on 128 (600 x 16, 40,960) and Kimi-K2 on 256
(800 x 8, 98,304), and reports rollout throughput gains of 44-104% and tail-latency reductions of
72-94% over veRL on the same inference engine (a range over the three workloads; the full
system, grouped speculative decoding included). Here each workload is the preset of
`configs/sim/` with its GPU count set to the published one: Moonlight and Qwen2-VL-72B as
instances of 8 GPUs (one node, tensor parallel), Kimi-K2 as 256 one-GPU instances with the
routed experts sharded over all of them; step costs from the roofline of the real model shapes
(`seer_jax.costs`: MoE weights touched per step, MLA latent cache) on H800. The length
distributions are the presets' synthetic ones (assumed, not the paper's data).

    .venv/bin/python benchmarks/paper_setting.py --json benchmarks/results/paper_setting.json
        [--workloads moonlight,kimi-k2] [--no-spec]
    .venv/bin/python benchmarks/paper_setting.py --costs-only   # the MoE cost table

Rows per workload: group_round_robin, seer, and seer + grouped SD (`--no-spec` leaves it out);
gain = tokens/s over group_round_robin's - 1, tail reduction = 1 - tail / its tail (tail: the
time the last 10% of responses took).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from seer_jax.config_files import load_config_file  # noqa: E402
from seer_jax.provenance import run_info  # noqa: E402
from seer_jax.sim import simulator as sim  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]

# workload -> (preset file, GPUs, GPUs per instance, published prompts, samples, max tokens)
SETTINGS = {
    "moonlight": ("configs/sim/moonlight.py", 32, 8, 400, 8, 65536),
    "qwen2-vl-72b": ("configs/sim/qwen2_vl_72b.py", 128, 8, 600, 16, 40960),
    "kimi-k2": ("configs/sim/kimi_k2.py", 256, 1, 800, 8, 98304),
}
PAPER = {"throughput_gain": [0.44, 1.04], "tail_reduction": [0.72, 0.94]}
BASELINE = "group_round_robin"


def paper_config(name: str):
    path, gpus, per_instance, prompts, samples, max_tokens = SETTINGS[name]
    cfg = load_config_file(ROOT / path)
    cfg.policies = f"seer,{BASELINE}"
    cfg.cluster.chips_per_instance = per_instance
    cfg.cluster.num_instances = gpus // per_instance
    w = cfg.workload
    if (w.num_prompts, w.group_size, w.max_tokens) != (prompts, samples, max_tokens):
        raise SystemExit(f"{path}: workload {w.num_prompts} x {w.group_size} up to "
                         f"{w.max_tokens} is not the published {prompts} x {samples} up to "
                         f"{max_tokens}")
    sim.validate_config(cfg)
    return cfg


def run_workload(name: str, spec: bool) -> dict:
    cfg = paper_config(name)
    work = sim.build_workload(cfg)
    runs, walls = {}, {}
    plan = [(BASELINE, BASELINE, False), ("seer", "seer", False)]
    if spec:
        plan.append(("seer + grouped SD", "seer", True))
    for label, pol, sd in plan:
        t = time.perf_counter()
        runs[label] = sim.simulate(cfg, pol, speculation=sd, workload=work, label=label)
        walls[label] = time.perf_counter() - t
        r = runs[label].report
        print(f"  {name} {label}: {r.tokens_per_s:,.0f} tokens/s, makespan {r.makespan_s:,.0f} s,"
              f" tail {r.tail_s:,.0f} s ({walls[label]:.0f} s to simulate)", flush=True)
    summ = sim.summarize(runs, BASELINE)
    cost = sim.build_cost_model(cfg)
    k = cfg.cluster
    rows = {}
    for label, row in summ.items():
        rows[label] = {key: row[key] for key in (
            "tokens_per_s", "makespan_s", "tail_s", "preemptions", "idle_fraction")}
        rows[label]["throughput_gain"] = row[f"tokens_per_s_ratio_vs_{BASELINE}"] - 1.0
        rows[label]["tail_reduction"] = row[f"tail_reduction_vs_{BASELINE}"]
        rows[label]["sim_wall_s"] = walls[label]
    return {
        "gpus": SETTINGS[name][1], "instances": int(k.num_instances),
        "gpus_per_instance": int(k.chips_per_instance), "expert_parallel": int(k.expert_parallel),
        "accelerator": k.accelerator, "model": k.model,
        "prompts": int(cfg.workload.num_prompts), "samples": int(cfg.workload.group_size),
        "max_tokens": int(cfg.workload.max_tokens), "workload": work.stats(),
        "cost_model": cost.describe(), "runs": rows,
    }


def print_table(results: dict) -> None:
    paper = (f"+{PAPER['throughput_gain'][0]:.0%}..{PAPER['throughput_gain'][1]:.0%} / "
             f"-{PAPER['tail_reduction'][0]:.0%}..{PAPER['tail_reduction'][1]:.0%}")
    print(f"\n| workload | GPUs | prompts x samples, max tokens | run | tokens/s | tail s | "
          f"throughput vs {BASELINE} | tail reduction | paper (all three workloads) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        shape = f"{r['prompts']} x {r['samples']}, {r['max_tokens']:,}"
        gpus = f"{r['gpus']} ({r['instances']} x {r['gpus_per_instance']})"
        for label, row in r["runs"].items():
            base = label == BASELINE
            gain = "" if base else f"{row['throughput_gain']:+.0%}"
            tail = "" if base else f"-{row['tail_reduction']:.0%}"
            print(f"| {name} | {gpus} | {shape} | {label} | {row['tokens_per_s']:,.0f} | "
                  f"{row['tail_s']:,.0f} | {gain} | {tail} | {'' if base else paper} |")


def cost_table() -> dict:
    """Per MoE model: parameters from its shapes, KV bytes per token, and the weight bytes a
    decode step reads per instance at several batch sizes (one H800; Kimi-K2 at EP 256)."""
    from seer_jax.costs import RooflineCostModel, get_accelerator, get_model

    out = {}
    print("\n| model | total params | active | shared | KV bytes/token | EP | "
          "weights read per step at batch 1 / 8 / 64 / 256 (GB) |")
    print("|---|---|---|---|---|---|---|")
    for name, ep in [("qwen3-30b-a3b", 1), ("qwen3-235b-a22b", 1), ("moonlight-16b-a3b", 1),
                     ("kimi-k2", 256)]:
        m = get_model(name)
        roof = RooflineCostModel(m, get_accelerator("h800"), expert_parallel=ep)
        reads = {b: roof.weight_bytes_read(b) for b in (1, 8, 64, 256)}
        out[name] = {"total_params": m.total_params, "active_params": m.active_params,
                     "shared_params": m.shared_params, "kv_bytes_per_token": m.kv_bytes_per_token,
                     "expert_parallel": ep, "weight_bytes_read": reads}
        print(f"| {name} | {m.total_params / 1e9:,.1f}B | {m.active_params / 1e9:.2f}B | "
              f"{m.shared_params / 1e9:.2f}B | {m.kv_bytes_per_token:,.0f} | {ep} | "
              + " / ".join(f"{v / 1e9:.1f}" for v in reads.values()) + " |")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="moonlight,qwen2-vl-72b,kimi-k2")
    ap.add_argument("--no-spec", action="store_true", help="leave out seer + grouped SD")
    ap.add_argument("--json", default="")
    ap.add_argument("--costs-only", action="store_true",
                    help="print the MoE cost table (parameters, KV, weights read) and stop")
    args = ap.parse_args()
    if args.costs_only:
        cost_table()
        return 0
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for n in names:
        if n not in SETTINGS:
            raise SystemExit(f"unknown workload {n!r}; known: {sorted(SETTINGS)}")
    info = run_info()  # the commit this ran at (taken first: the tree may change meanwhile)
    t0 = time.perf_counter()
    results = {}
    for n in names:
        results[n] = run_workload(n, spec=not args.no_spec)
    print_table(results)
    summary = {n: {label: {"throughput_gain": row["throughput_gain"],
                           "tail_reduction": row["tail_reduction"],
                           "tokens_per_s": row["tokens_per_s"]}
                   for label, row in r["runs"].items() if label != BASELINE}
               for n, r in results.items()}
    summary["paper"] = PAPER
    summary["seconds"] = time.perf_counter() - t0
    if args.json:
        out = {"summary": summary, "workloads": results, "run": info}
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=float))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
