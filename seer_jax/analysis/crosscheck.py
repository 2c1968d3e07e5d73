"""Cross-checking the simulator against measured runs: a simulator config calibrated from a
rollout's length trace and step profile, and the runs `benchmarks/sim_crosscheck.py` records."""

from __future__ import annotations

import json

import ml_collections

from seer_jax.analysis.policies import CATALOG
from seer_jax.sim import simulator as sim
from seer_jax.sim.workloads import load_trace


def calibrated_config(
    trace_path: str,
    profile_path: str | None,
    *,
    num_instances: int,
    kv_capacity_tokens: int,
    chunk_size: int,
    model: str = "smollm2-135m",
    page_size: int = 16,
    max_batch_size: int = 256,
    max_prefill_tokens: int = 8192,
    balance_threshold: int = 32,
    max_tokens: int = 0,
    pool_gbps: float = 20.0,
    accelerator: str = "h100",
    chips_per_instance: int = 1,
) -> ml_collections.ConfigDict:
    """A config that replays a rollout trace (JSONL written by `seer-jax rollout`) on instances
    whose step time comes from a measured profile (`seer-jax bench --profile`, or
    `StepProfile.from_steps` over an emulated run's executed steps). `profile_path=None`: the
    roofline of `model` on `accelerator` x `chips_per_instance` instead (what an emulated run
    with `time_model="roofline"` is timed by)."""
    c = sim.default_config()
    c.name = f"calibrated:{trace_path}"
    c.workload.trace_path = str(trace_path)
    c.workload.max_tokens = int(max_tokens or load_trace(trace_path).max_tokens)
    c.workload.trace_max_tokens = int(max_tokens)  # 0: the trace's own
    c.cluster.num_instances = int(num_instances)
    c.cluster.model = model
    c.cluster.profile_path = str(profile_path) if profile_path else ""
    c.cluster.accelerator = accelerator
    c.cluster.chips_per_instance = int(chips_per_instance)
    c.cluster.kv_capacity_tokens = int(kv_capacity_tokens)
    c.cluster.page_size = int(page_size)
    c.cluster.max_batch_size = int(max_batch_size)
    c.cluster.max_prefill_tokens = int(max_prefill_tokens)
    c.cluster.pool_gbps = float(pool_gbps)
    c.cluster.macro_steps = 1  # small runs: exact iterations
    c.controller.chunk_size = int(chunk_size)
    c.controller.balance_threshold = int(balance_threshold)
    sim.validate_config(c, CATALOG)
    return c


def load_recorded_run(run_dir) -> tuple[dict, ml_collections.ConfigDict]:
    """A run recorded by `benchmarks/sim_crosscheck.py` (run.json, trace.jsonl, profile.json in
    `run_dir`): its saved fields and the calibrated simulator config, pointed at those files."""
    import pathlib

    run_dir = pathlib.Path(run_dir)
    saved = json.loads((run_dir / "run.json").read_text())
    sim_cfg = saved["sim_config"]
    # runs recorded before traces kept their own max_tokens set it through workload.max_tokens
    sim_cfg["workload"].setdefault("trace_max_tokens", sim_cfg["workload"]["max_tokens"])
    # runs recorded before policies had their own options kept seer's in the controller's,
    # and used the paper's estimator when they named none
    ctl = sim_cfg["controller"]
    seer = {"estimator": ctl.pop("seer_estimator", "max_finished")}
    for old, new in (("seer_quantile", "quantile"), ("starvation_pops", "starvation_pops")):
        if old in ctl:
            seer[new] = ctl.pop(old)
    sim_cfg.setdefault("policy", {}).setdefault("seer", {}).update(seer)
    cfg = sim.default_config()
    cfg.update(ml_collections.ConfigDict(sim_cfg))
    cfg.workload.trace_path = str(run_dir / "trace.jsonl")
    if cfg.cluster.profile_path:
        cfg.cluster.profile_path = str(run_dir / "profile.json")
    return saved, cfg


def predict_from_trace(trace_path: str, profile_path: str | None, policies: list[str] | None = None,
                       **kw) -> dict[str, dict]:
    """Calibrate from a trace + step profile and predict per policy tokens_per_s, makespan_s,
    tail_s (the cross-check against an emulated run). kw: see `calibrated_config`."""
    cfg = calibrated_config(trace_path, profile_path, **kw)
    runs = sim.compare(cfg, catalog=CATALOG, policies=policies or ["seer", "group_round_robin", "request_fcfs", "oracle_lfs"])
    return sim.summarize(runs)
