"""Cluster simulator: the real controller and policies driving simulated instances on a virtual
clock, with a cost model per instance and a paper-scale workload.

Config schema: `default_config()` (configs/sim/*.py start from it); `validate_config(cfg)` turns
a bad value into one ConfigError naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import ml_collections
import numpy as np

from seer_jax import costs as cm
from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies import CATALOG, Hindsight, PolicyCatalog
from seer_jax.rollout.core.policies.base import options_for
from seer_jax.sim import workloads as wl
from seer_jax.sim.config import (  # noqa: F401 (the simulator's public API)
    build_accelerator,
    build_cost_model,
    build_workload,
    default_config,
    kv_capacity_pages,
    max_tokens_source,
    policy_list,
    preset_workload_fields,
    validate_config,
)

# ----------------------------------------------------------------------------------------------
# Running the real controller on simulated instances
# ----------------------------------------------------------------------------------------------

PROMPT_TOKEN_ID = 7  # simulated prompts are runs of one token; only their length matters


@dataclasses.dataclass
class _LightResult:
    """What `rollout.report.build_report` reads from a response (without copying its tokens)."""

    num_tokens: int
    group_index: int
    finished_at: float
    submitted_at: float
    finish_reason: str

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.submitted_at


@dataclasses.dataclass
class SimRun:
    """One simulated rollout of one policy."""

    label: str
    policy: str
    speculation: bool
    report: Any  # seer_jax.rollout.core.report.RolloutReport
    latencies: np.ndarray  # [num_responses] seconds
    steps: np.ndarray  # [num_steps, 4]: instance, start_s, end_s, batch size
    num_instances: int
    wall_s: float
    driver_steps: int
    iterations: int
    controller: Any = None  # the Controller, when simulate(keep_controller=True)

    @property
    def events_per_s(self) -> float:
        return self.driver_steps / self.wall_s if self.wall_s > 0 else 0.0

    def row(self) -> dict:
        r = self.report
        return {
            "label": self.label,
            "policy": self.policy,
            "speculation": self.speculation,
            "tokens_per_s": r.tokens_per_s,
            "makespan_s": r.makespan_s,
            "tail_s": r.tail_s,
            "latency_p50_s": r.latency_p50_s,
            "latency_p90_s": r.latency_p90_s,
            "latency_p99_s": r.latency_p99_s,
            "latency_max_s": r.latency_max_s,
            "idle_fraction": 1.0 - r.mean_busy_fraction,
            "preemptions": r.preemptions,
            "migrations": r.migrations,
            "chunks": r.chunks,
            "spec_acceptance": r.spec_acceptance,
            "output_tokens": r.output_tokens,
            "length_icc": r.length_icc,
            "sim_wall_s": self.wall_s,
            "sim_events": self.driver_steps,
            "sim_events_per_s": self.events_per_s,
            "sim_iterations": self.iterations,
        }

    def in_flight_series(self, num_bins: int = 500) -> tuple[np.ndarray, np.ndarray]:
        """Running sequences summed over instances, time-averaged in `num_bins` bins."""
        from seer_jax.sim.plots import bin_timeline

        edges, busy, batch = bin_timeline(self.steps, self.num_instances,
                                          self.report.makespan_s, num_bins)
        return edges[:-1], (busy * batch).sum(axis=0)


class CoarseStepTime:
    """Step time when one simulated token stands for `q` real tokens (`cluster.token_unit`):
    a simulated decode step is q real iterations (context read at its midpoint), a prefill of n
    simulated tokens is one real step over n·q tokens."""

    def __init__(self, step_time, q: int):
        self.step_time = step_time
        self.q = q

    def __call__(self, batch_size: int, num_prefill_tokens: int, num_decode_tokens: int,
                 kv_tokens_read: int) -> float:
        q = self.q
        t = 0.0
        if num_prefill_tokens:
            t += self.step_time(batch_size, num_prefill_tokens * q, 0, kv_tokens_read * q)
        if num_decode_tokens:
            mid = kv_tokens_read * q + (num_decode_tokens * (q - 1)) // 2
            t += q * self.step_time(batch_size, 0, num_decode_tokens, mid)
        return t


def spec_model(cfg: ml_collections.ConfigDict):
    from seer_jax.sim.spec_instance import SpecModel

    s = cfg.spec
    calibration = None
    if s.get("calibration"):
        from seer_jax.drafting.calibration import SpecCalibration

        calibration = SpecCalibration.load(s.calibration)
    return SpecModel(
        acceptance=tuple(float(x) for x in s.acceptance),
        solo_acceptance=tuple(float(x) for x in s.solo_acceptance),
        gamma_max=int(s.gamma_max),
        priority_weight=float(s.priority_weight),
        draft_overhead_s=float(s.draft_overhead_ms) * 1e-3,
        calibration=calibration,
    )


def sim_instances(cfg: ml_collections.ConfigDict, lengths: dict[str, int], pool, n_inst: int,
                  speculation: bool = False, group_size: int = 1) -> list:
    """`n_inst` simulated instances of `cfg.cluster` sharing `pool`; `lengths`: request id ->
    output length in simulated tokens (read when a request is first submitted, so it may grow)."""
    from seer_jax.sim.spec_instance import FastSimInstance, GroupProgress

    k = cfg.cluster
    q = int(k.token_unit)
    cost = build_cost_model(cfg)
    page_sim = max(1, int(k.page_size) // q)
    cap_tokens = (int(k.kv_capacity_tokens) if k.kv_capacity_tokens
                  else cost.kv_capacity_tokens())
    pages = cap_tokens // (page_sim * q)
    progress = GroupProgress(group_size)
    spec = spec_model(cfg) if speculation else None
    kv_bytes = int(cm.get_model(k.model).kv_bytes_per_token) * q
    step_time = cost.step_time if q == 1 else CoarseStepTime(cost.step_time, q)
    return [
        FastSimInstance(
            i, lengths, pool=pool, kv_capacity_pages=pages, page_size=page_sim,
            max_batch_size=int(k.max_batch_size),
            max_prefill_tokens=max(1, int(k.max_prefill_tokens) // q),
            step_time=step_time, kv_bytes_per_token=kv_bytes,
            pool_bandwidth_bytes_per_s=k.pool_gbps * 1e9, macro_steps=int(k.macro_steps),
            spec=spec, progress=progress,
        )
        for i in range(n_inst)
    ]


def controller_config(cfg: ml_collections.ConfigDict) -> dict:
    """`cfg.controller` with chunk sizes in simulated tokens (units of cluster.token_unit)."""
    q = int(cfg.cluster.token_unit)
    ctl_cfg = cfg.controller.to_dict()
    if q > 1:
        ctl_cfg["chunk_size"] = max(1, int(ctl_cfg["chunk_size"]) // q)
        ctl_cfg["min_chunk_size"] = max(1, int(ctl_cfg["min_chunk_size"]) // q)
    return ctl_cfg


def simulate(
    cfg: ml_collections.ConfigDict,
    policy: str,
    *,
    speculation: bool = False,
    workload: wl.Workload | None = None,
    label: str | None = None,
    num_instances: int | None = None,
    keep_controller: bool = False,
    catalog: PolicyCatalog = CATALOG,
) -> SimRun:
    """Run the real controller with `policy` over simulated instances; returns the run and its
    `RolloutReport` (same metrics as `seer-jax rollout`)."""
    from seer_jax.rollout.backends.kv_pool import HostKVPool
    from seer_jax.rollout.core.controller import Controller
    from seer_jax.rollout.core.driver import EmulatedClusterDriver
    from seer_jax.rollout.core.report import build_report

    policy_list(policy, catalog)
    work = workload if workload is not None else build_workload(cfg)
    sizes = np.bincount(work.group_index)
    if sizes.min() != sizes.max():
        raise ConfigError(
            f"workload {work.name!r} has groups of different sizes ({sizes.min()}..{sizes.max()}); "
            "the controller samples every prompt the same number of times"
        )
    group_size = int(sizes[0])
    k = cfg.cluster
    n_inst = int(num_instances or k.num_instances)
    q = int(k.token_unit)
    pool = HostKVPool()
    lengths: dict[str, int] = {}  # in simulated tokens (units of q real tokens)
    real_len: dict[str, int] = {}
    group_prompt_len: list[int] = []
    for g, idx in enumerate(work.groups()):
        gid = work.group_ids[g]
        group_prompt_len.append(max(1, round(int(work.prompt_len[idx[0]]) / q)))
        for j, i in enumerate(idx):
            lengths[f"{gid}/{j}"] = -(-int(work.output_len[i]) // q)
            real_len[f"{gid}/{j}"] = int(work.output_len[i])
    instances = sim_instances(cfg, lengths, pool, n_inst, speculation, group_size)
    dists = work.length_distributions()
    if dists is not None:
        dists = {g: (m - math.log(q), s) for g, (m, s) in dists.items()}  # simulated tokens
    pol = catalog.make(policy, Hindsight(true_lengths=lengths, length_distributions=dists))
    prompts = [(PROMPT_TOKEN_ID,) * p for p in group_prompt_len]
    ctl_cfg = controller_config(cfg)
    ctl = Controller(
        prompts, group_size=group_size, max_tokens=-(-int(work.max_tokens) // q),
        instances=instances, policy=pol, config=ctl_cfg,
        pool=pool, group_ids=list(work.group_ids),
        policy_options=options_for(pol, cfg.policy.to_dict()),
    )
    driver = EmulatedClusterDriver(ctl)
    t0 = time.perf_counter()
    driver.run()
    wall = time.perf_counter() - t0
    light = [
        _LightResult(real_len[r.request_id] if q > 1 else r.generated, r.group.index,
                     float(r.finished_at), float(r.submitted_at), str(r.finish_reason))
        for g in ctl.groups for r in g.requests
    ]
    report = build_report(light, ctl, driver, pool=pool)
    steps = []
    for inst in instances:
        tl = inst.timeline()
        if len(tl):
            steps.append(np.concatenate([np.full((len(tl), 1), inst.instance_id), tl], axis=1))
    steps_arr = np.concatenate(steps) if steps else np.zeros((0, 4))
    return SimRun(
        label=label or (policy + (" + grouped SD" if speculation else "")),
        policy=policy,
        speculation=speculation,
        report=report,
        latencies=np.array([x.latency_s for x in light]),
        steps=steps_arr,
        num_instances=n_inst,
        wall_s=wall,
        driver_steps=sum(tl.steps for tl in driver.timelines),
        iterations=sum(inst.iterations for inst in instances) * q,
        controller=ctl if keep_controller else None,
    )


# ----------------------------------------------------------------------------------------------
# Comparisons, ablation, sweep
# ----------------------------------------------------------------------------------------------

ABLATION_STEPS = (
    ("divided (request_fcfs)", "request_fcfs", False),
    ("+ context (seer)", "seer", False),
    ("+ grouped SD (seer + spec)", "seer", True),
)


def compare(cfg: ml_collections.ConfigDict, policies: list[str] | None = None,
            workload: wl.Workload | None = None,
            catalog: PolicyCatalog = CATALOG) -> dict[str, SimRun]:
    """Each policy on the same workload (same lengths, same seed)."""
    work = workload if workload is not None else build_workload(cfg)
    names = policies or policy_list(cfg.policies, catalog)
    return {p: simulate(cfg, p, workload=work, catalog=catalog) for p in names}


def ablation(cfg: ml_collections.ConfigDict, workload: wl.Workload | None = None,
             include_baseline: bool = True) -> dict[str, SimRun]:
    """The paper's ladder: divided rollout only -> + context-aware scheduling -> + grouped SD
    (and the group_round_robin baseline the ratios refer to)."""
    work = workload if workload is not None else build_workload(cfg)
    runs: dict[str, SimRun] = {}
    if include_baseline:
        runs["group_round_robin"] = simulate(cfg, "group_round_robin", workload=work)
    for label, pol, spec in ABLATION_STEPS:
        runs[label] = simulate(cfg, pol, speculation=spec, workload=work, label=label)
    return runs


def summarize(runs: dict[str, SimRun], baseline: str = "group_round_robin") -> dict[str, dict]:
    """The JSON `summary`: per run tokens_per_s, makespan_s, tail_s, latency percentiles, idle
    fraction, preemptions and ratios vs `baseline` (`tokens_per_s_ratio_vs_<b>`,
    `makespan_ratio_vs_<b>`, `tail_reduction_vs_<b>` in 0..1)."""
    base = runs.get(baseline)
    out = {}
    for name, run in runs.items():
        row = {k: v for k, v in run.row().items() if k not in ("label",)}
        if base is not None:
            b = base.report
            r = run.report
            row[f"tokens_per_s_ratio_vs_{baseline}"] = (
                r.tokens_per_s / b.tokens_per_s if b.tokens_per_s > 0 else None)
            row[f"makespan_ratio_vs_{baseline}"] = (
                r.makespan_s / b.makespan_s if b.makespan_s > 0 else None)
            row[f"tail_reduction_vs_{baseline}"] = (
                min(1.0, max(0.0, 1.0 - r.tail_s / b.tail_s)) if b.tail_s > 0 else None)
        out[name] = row
    return out


def sweep(cfg: ml_collections.ConfigDict, progress=None, catalog: PolicyCatalog = CATALOG) -> dict:
    """Seer's gain over group_round_robin and request_fcfs across ICC x tail heaviness.

    The workload keeps the config's max_tokens / truncation / group size; `sweep.num_prompts`
    (0 = the config's) sets its size, and the instance count scales with it so the load per
    instance stays the same as in the config."""
    sw = cfg.sweep
    base_prompts = int(cfg.workload.num_prompts)
    n_prompts = int(sw.num_prompts) or base_prompts
    n_inst = max(1, round(int(cfg.cluster.num_instances) * n_prompts / base_prompts))
    pols = policy_list(sw.policies, catalog)
    if "seer" not in pols:
        raise ConfigError("config.sweep.policies must include seer")
    iccs = [float(x) for x in sw.iccs]
    sigmas = [float(x) for x in sw.sigmas]
    cells = []
    gains = {p: np.zeros((len(sigmas), len(iccs))) for p in pols if p != "seer"}
    tails = {p: np.zeros((len(sigmas), len(iccs))) for p in pols if p != "seer"}
    for j, s in enumerate(sigmas):
        for i, icc in enumerate(iccs):
            c = _with_workload(cfg, num_prompts=n_prompts, icc=icc, sigma=s)
            work = build_workload(c)
            runs = {p: simulate(c, p, workload=work, num_instances=n_inst, catalog=catalog)
                    for p in pols}
            seer = runs["seer"].report
            cell = {"icc_target": icc, "sigma": s,
                    "icc_measured": wl.length_icc(work.output_len, work.group_index),
                    "top10_token_share": work.stats()["longest_10pct_token_share"]}
            for p, run in runs.items():
                cell[f"{p}_tokens_per_s"] = run.report.tokens_per_s
                cell[f"{p}_tail_s"] = run.report.tail_s
                if p != "seer":
                    gains[p][j, i] = seer.tokens_per_s / run.report.tokens_per_s
                    tails[p][j, i] = 1.0 - seer.tail_s / run.report.tail_s if run.report.tail_s \
                        else 0.0
                    cell[f"seer_tokens_per_s_ratio_vs_{p}"] = gains[p][j, i]
                    cell[f"seer_tail_reduction_vs_{p}"] = tails[p][j, i]
            cells.append(cell)
            if progress:
                progress(cell)
    out = {"iccs": iccs, "sigmas": sigmas, "num_prompts": n_prompts, "num_instances": n_inst,
           "cells": cells, "gain": {p: g.tolist() for p, g in gains.items()},
           "tail_reduction": {p: t.tolist() for p, t in tails.items()}}
    if sw.reference_trace:
        ref = wl.load_trace(sw.reference_trace)
        out["reference"] = {"trace": str(sw.reference_trace),
                            **wl.log_length_spread(ref.output_len, ref.group_index)}
    return out


def _with_workload(cfg: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict(cfg.to_dict())
    for k, v in fields.items():
        c.workload[k] = v
    return c


def write_plots(runs: dict[str, SimRun], out_dir, title: str = "") -> list:
    """Timelines per run, the latency CDF and tokens in flight of all runs; returns the paths."""
    import pathlib

    from seer_jax.sim import plots

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, run in runs.items():
        slug = "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")
        paths.append(plots.plot_instance_timelines(
            run.steps, run.num_instances, run.report.makespan_s,
            out / f"timeline_{slug}.png", title=f"{title} {name}: batch size per instance".strip()))
    paths.append(plots.plot_latency_cdf({n: r.latencies for n, r in runs.items()},
                                        out / "latency_cdf.png", title=f"{title} latency CDF"))
    paths.append(plots.plot_tokens_in_flight(
        {n: r.in_flight_series() for n, r in runs.items()}, out / "tokens_in_flight.png",
        ylabel="running sequences (all instances)", title=f"{title} tokens in flight".strip()))
    return paths
