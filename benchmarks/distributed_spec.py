"""Grouped speculative decoding on 2 Ray actors (distributed draft service) vs in process (one
shared draft service), on the same rollout. Run through `benchmarks/distributed.py --speculation`.

Usage:
  python benchmarks/distributed.py --speculation --model smollm2 --json PATH   # natural prompts
  python benchmarks/distributed.py --speculation --model random --json PATH    # 768 x 6, greedy

Workload: `--groups` prompts x G=4 responses of up to `--max-tokens` tokens, chunks of 16
tokens (seer policy), 2 instances. `smollm2`: the built-in natural prompts through the chat
template, `--temperature` (1.0; at 0 the in-process and Ray rows emit the same tokens, so
their acceptance differs only by the replicas' staleness), SmolLM2-135M; `random`: a random
768 x 6 model (`--hidden`, `--layers`), random prompts, greedy. The speculation budget is the
roofline of the served model on an H100, per instance, on every row (given explicitly: a
budget left to its default would fit the CPU's measured steps, and its drafts would depend on
the timing of the run). Every wall-timed run follows a warm-up run of the same workload (the
emulated-clock rows need none: compiles do not count on that clock).

Rows:
- inprocess_spec: 2 in-process slices sharing one `InProcessDraftService`, clock concurrent;
- ray_spec: 2 Ray actors, each drafting from its replica of the draft service (1 shard, pulls
  waited for once `--max-stale-steps` old, default 1), clock concurrent; ray_plain: the same actors' workload without speculation;
- roofline_spec / roofline_plain: in process, emulated clock with the roofline step time on an
  H100 (what `time_model=roofline` uses) of `--cost-model` (SmolLM2) or of the random model's
  own shape: the modelled tokens/s.
`--rows` picks rows (inprocess_spec, roofline, ray_spec, ray_plain); the JSON is written after
every row, so a run cut short keeps what it measured.
Per row: accepted draft tokens per sequence decode step (the mean accepted draft length, which
the drafts decide) and per engine decode step (which the batching also moves), acceptance,
tokens/s; for ray_spec also bytes
pushed and pulled per step, the mean pull latency (issue -> applied), the time steps waited for
late pulls, and the actor's host time drafting + syncing per step against the mean step.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax

from seer_jax.drafting.replicated import SyncConfig
from seer_jax.drafting.service import InProcessDraftService
from seer_jax.engine.engine import EngineConfig
from seer_jax.engine.speculation import Speculator
from seer_jax.provenance import run_info
from seer_jax.rollout.backends.engine_instance import make_engine_instances
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.backends.ray_cluster import RayBackendConfig, ensure_ray
from seer_jax.rollout.core.run import rollout
from seer_jax.rollout.core.types import SamplingParams

ENGINE = EngineConfig(page_size=16, kv_memory_gib=0.5, max_num_seqs=16,
                      max_num_batched_tokens=128, max_prefill_seqs=4)


def roofline_budget(cfg):
    """A budget factory (built on each actor, a nested function so that it travels by value):
    the H100 roofline of the served model."""
    from seer_jax.drafting.budget import BudgetConfig, default_step_time

    step_time = default_step_time(BudgetConfig(), cfg.cost_spec())

    def make():
        from seer_jax.drafting.budget import SpeculationBudget

        return SpeculationBudget(step_time)
    return make


def _row(out, wall, steps):
    rep = out.report
    decode_steps = sum(1 for r in steps if r[2] > 0)
    return {"tokens_per_s": rep.output_tokens / wall, "wall_s": wall,
            "output_tokens": rep.output_tokens, "steps": len(steps), "decode_steps": decode_steps,
            "spec_proposed": rep.spec_proposed, "spec_accepted": rep.spec_accepted,
            # the mean accepted draft length: per sequence decode step (what draft quality
            # decides), and per engine step (which also depends on how many sequences a step
            # carries, i.e. on the batching)
            "sequence_decode_steps": rep.decode_steps,
            "accepted_per_sequence_step": rep.accepted_per_decode_step,
            "accepted_per_decode_step": rep.spec_accepted / max(decode_steps, 1),
            "accepted_per_token": rep.spec_accepted / max(rep.output_tokens, 1),
            "acceptance": rep.spec_acceptance, "migrations": rep.migrations,
            "mean_step_s": sum(r[4] for r in steps) / max(len(steps), 1)}


def _rollout(instances, pool, prompts, args, sampling, clock):
    return rollout(prompts, group_size=4, max_tokens=args.max_tokens, instances=instances,
                   sampling=sampling, policy="seer", pool=pool, config={"chunk_size": 16},
                   clock=clock)


def _inprocess(cfg, params, prompts, args, sampling, speculation, step_time=None):
    def build():
        pool = HostKVPool()
        specs = None
        if speculation:
            service = InProcessDraftService()
            specs = [Speculator(service, roofline_budget(cfg)()) for _ in range(2)]
        insts = make_engine_instances(
            cfg, params, num_instances=2, tp=1, pool=pool, devices=jax.devices()[:2],
            engine_config=dataclasses.replace(ENGINE, speculation=speculation),
            speculators=specs, step_time=step_time, record_steps=True)
        return insts, pool

    clock = "concurrent" if step_time is None else "emulated"
    if step_time is None:  # the emulated clock's time does not count compiles: no warm-up
        insts, pool = build()
        _rollout(insts, pool, prompts, args, sampling, clock)  # warm-up: compile every shape
    insts, pool = build()
    t0 = time.perf_counter()
    out = _rollout(insts, pool, prompts, args, sampling, clock)
    wall = time.perf_counter() - t0
    row = _row(out, wall, [r for i in insts for r in i.step_log])
    if step_time is not None:
        row["modelled_tokens_per_s"] = out.report.tokens_per_s
        row["modelled_makespan_s"] = out.report.makespan_s
    return out, row


def _ray(cfg, weights, prompts, args, sampling, speculation, backend):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    group = make_ray_instances(cfg, weights, num_instances=2, tp=1, backend=backend,
                               engine_config=dataclasses.replace(ENGINE, speculation=speculation),
                               eos_ids=cfg.eos_token_ids, record_steps=True,
                               spec_budget=roofline_budget(cfg) if speculation else None,
                               draft_service=SyncConfig(max_stale_steps=args.max_stale_steps))
    try:
        _rollout(group.instances, group.pool, prompts, args, sampling, "concurrent")  # warm-up
        group.reset()
        t0 = time.perf_counter()
        out = _rollout(group.instances, group.pool, prompts, args, sampling, "concurrent")
        wall = time.perf_counter() - t0
        steps = group.step_logs()
        row = _row(out, wall, steps)
        stats = group.draft_stats()
    finally:
        group.shutdown()
    if stats is not None:
        rep = stats["replicas"]
        n = max(rep["steps"], 1)
        host = (rep["draft_s"] + rep["sync_s"]) / n
        row.update({
            "replica_steps": rep["steps"],
            "bytes_pushed_per_step": rep["bytes_pushed"] / n,
            "bytes_pulled_per_step": rep["bytes_pulled"] / n,
            "pull_latency_mean_s": rep["pull_latency_s"] / max(rep["pulls"], 1),
            "waited_pulls": rep["waited_pulls"], "wait_s": rep["wait_s"],
            "remote_tokens": rep["remote_tokens"],
            "host_draft_sync_s_per_step": host,
            "host_draft_s_per_step": rep["draft_s"] / n,
            "host_sync_s_per_step": rep["sync_s"] / n,
            "host_fraction_of_step": host / row["mean_step_s"] if row["mean_step_s"] else None,
            "draft_service": stats})
    return out, row


def _summary(rows: dict, model_name: str) -> dict:
    """The headline numbers of the rows that ran (None where a row is missing)."""
    inp, rs, rp = (rows.get(k, {}) for k in ("inprocess_spec", "ray_spec", "ray_plain"))
    rspec, rplain = rows.get("roofline_spec", {}), rows.get("roofline_plain", {})

    def ratio(a, b):
        return a / b if a is not None and b else None

    return {
        "model": model_name,
        "accepted_per_sequence_step_inprocess": inp.get("accepted_per_sequence_step"),
        "accepted_per_sequence_step_ray": rs.get("accepted_per_sequence_step"),
        "ray_vs_inprocess_accepted_per_sequence_step": ratio(
            rs.get("accepted_per_sequence_step"), inp.get("accepted_per_sequence_step")),
        "accepted_per_decode_step_inprocess": inp.get("accepted_per_decode_step"),
        "accepted_per_decode_step_ray": rs.get("accepted_per_decode_step"),
        "ray_vs_inprocess_accepted_per_step": ratio(rs.get("accepted_per_decode_step"),
                                                    inp.get("accepted_per_decode_step")),
        "ray_vs_inprocess_accepted_per_token": ratio(rs.get("accepted_per_token"),
                                                     inp.get("accepted_per_token")),
        "acceptance_inprocess": inp.get("acceptance"), "acceptance_ray": rs.get("acceptance"),
        "bytes_pushed_per_step": rs.get("bytes_pushed_per_step"),
        "bytes_pulled_per_step": rs.get("bytes_pulled_per_step"),
        "pull_latency_mean_s": rs.get("pull_latency_mean_s"),
        "host_draft_sync_s_per_step": rs.get("host_draft_sync_s_per_step"),
        "ray_mean_step_s": rs.get("mean_step_s"),
        "host_fraction_of_step": rs.get("host_fraction_of_step"),
        "ray_spec_tokens_per_s": rs.get("tokens_per_s"),
        "ray_plain_tokens_per_s": rp.get("tokens_per_s"),
        "inprocess_spec_tokens_per_s": inp.get("tokens_per_s"),
        "roofline_spec_tokens_per_s": rspec.get("modelled_tokens_per_s"),
        "roofline_plain_tokens_per_s": rplain.get("modelled_tokens_per_s"),
        "roofline_speedup": ratio(rspec.get("modelled_tokens_per_s"),
                                  rplain.get("modelled_tokens_per_s")),
    }


def main(args, random_workload=None) -> int:
    """random_workload: (cfg, params, prompts) of the random model (from distributed.py)."""
    from seer_jax.costs import RooflineCostModel, get_accelerator, get_model

    if args.model == "smollm2":
        from seer_jax.model import load
        from seer_jax.rollout.api import build_prompts
        from seer_jax.rollout.config import default_config
        from seer_jax.rollout.settings import PromptSettings

        cfg, params, tok = load("smollm2")
        c = default_config()
        c.num_prompts = args.groups
        prompts, _ = build_prompts(PromptSettings.from_config(c), tok)
        weights = "smollm2"  # each actor loads it
        sampling = SamplingParams(temperature=args.temperature, seed=0)
        model_name = ("smollm2-135m (natural prompts, chat template, temperature "
                      f"{args.temperature})")
    else:
        cfg, params, prompts = random_workload
        weights = params
        sampling = SamplingParams(temperature=0.0)
        model_name = f"random hidden {args.hidden} x {args.layers} layers (greedy)"
    served = get_model(args.cost_model) if args.model == "smollm2" else cfg.cost_spec()
    roofline = RooflineCostModel(model=served, accelerator=get_accelerator("h100"), chips=1,
                                 page_size=ENGINE.page_size)
    want = set(args.rows.split(","))
    rows: dict = {}
    workload = {"groups": args.groups, "group_size": 4, "max_tokens": args.max_tokens,
                "chunk_size": 16, "policy": "seer", "instances": 2, "model": model_name,
                "roofline_model": served.name, "engine": dataclasses.asdict(ENGINE)}

    def write():  # after every row: a run cut short keeps the rows it has
        report = {"summary": _summary(rows, model_name), "run": run_info(),
                  "workload": workload, "runs": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2, default=str)
        return report

    if "inprocess_spec" in want:
        _, rows["inprocess_spec"] = _inprocess(cfg, params, prompts, args, sampling, True)
        print("inprocess_spec", json.dumps(rows["inprocess_spec"]), flush=True)
        write()
    if "roofline" in want:
        _, rows["roofline_spec"] = _inprocess(cfg, params, prompts, args, sampling, True, roofline)
        _, rows["roofline_plain"] = _inprocess(cfg, params, prompts, args, sampling, False,
                                               roofline)
        print("roofline", rows["roofline_spec"]["modelled_tokens_per_s"],
              rows["roofline_plain"]["modelled_tokens_per_s"], flush=True)
        write()
    if want & {"ray_spec", "ray_plain"}:
        backend = RayBackendConfig(object_store_mb=400, pin_cpus=True, step_timeout_s=600.0,
                                   env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
        ray = ensure_ray(backend, min_cpus=4)
        try:
            for name, spec in (("ray_spec", True), ("ray_plain", False)):
                if name in want:
                    _, rows[name] = _ray(cfg, weights, prompts, args, sampling, spec, backend)
                    print(name, json.dumps({k: v for k, v in rows[name].items()
                                            if k != "draft_service"}), flush=True)
                    write()
        finally:
            ray.shutdown()
    print(json.dumps(write()["summary"], indent=2))
    return 0
