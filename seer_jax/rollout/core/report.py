"""Rollout report: the metrics of one rollout, a rich table, and the JSON `summary`.

Metrics (times in seconds on the driver's clock, the rollout starts at 0):
- output tokens, makespan (last response finished), output tokens/s = tokens / makespan;
- latency p50/p90/p99/max of responses (submitted -> finished);
- tail time: how long the last 10% of responses took = makespan - the time by which 90% had
  finished (the long tail);
- per-instance busy/idle fractions of the makespan (busy = sum of step durations) and the time
  each instance was last busy;
- preemptions, migrations, chunks, re-prefilled tokens, KV bytes imported/exported by instances
  and moved through the pool, speculative acceptance (accepted / proposed draft tokens; None when
  speculation was off);
- length statistics: the intra-class correlation of log output lengths within groups (one-way
  ANOVA ICC(1), `length_icc`), and the share of output tokens in the longest 10% of responses.
`compare_summary` turns reports of several policies into the issue's comparison summary
(`tokens_per_s_ratio_vs_<baseline>`, `tail_reduction_vs_<baseline>`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def length_icc(lengths: Sequence[float], group_index: Sequence[int], log: bool = True) -> float | None:
    """One-way random-effects ICC(1) of lengths grouped by `group_index` (log lengths by default).

    ICC = (MSB - MSW) / (MSB + (n0 - 1) MSW) with n0 the ANOVA group-size constant for unequal
    groups. None when undefined (fewer than 2 groups, no within-group replication, no variance).
    """
    x = np.asarray(lengths, dtype=np.float64)
    gi = np.asarray(group_index)
    if len(x) == 0:
        return None
    if log:
        x = np.log(np.maximum(x, 1.0))
    _, inv, counts = np.unique(gi, return_inverse=True, return_counts=True)
    k = len(counts)
    n = len(x)
    if k < 2 or n - k < 1:
        return None
    means = np.bincount(inv, weights=x) / counts
    grand = x.mean()
    ssb = float(np.sum(counts * (means - grand) ** 2))
    ssw = float(np.sum((x - means[inv]) ** 2))
    msb = ssb / (k - 1)
    msw = ssw / (n - k)
    n0 = (n - np.sum(counts.astype(np.float64) ** 2) / n) / (k - 1)
    denom = msb + (n0 - 1) * msw
    if denom <= 0:
        return None
    return float((msb - msw) / denom)


def top_share(lengths: Sequence[float], fraction: float = 0.1) -> float:
    """Share of all tokens that sit in the longest `fraction` of responses (at least one)."""
    x = np.sort(np.asarray(lengths, dtype=np.float64))[::-1]
    total = x.sum()
    if total <= 0:
        return 0.0
    k = max(1, int(round(fraction * len(x))))
    return float(x[:k].sum() / total)


def tail_time(finish_times: Sequence[float], fraction: float = 0.1) -> float:
    """Time the last `fraction` of requests took: makespan - time by which (1-fraction) finished."""
    t = np.sort(np.asarray(finish_times, dtype=np.float64))
    if len(t) == 0:
        return 0.0
    k = max(1, math.ceil((1.0 - fraction) * len(t)))
    return float(t[-1] - t[k - 1])


@dataclasses.dataclass
class InstanceReport:
    instance_id: int
    busy_s: float
    busy_fraction: float
    idle_fraction: float
    steps: int
    last_busy_at: float
    lost_at: float | None
    chunks: int = 0  # chunks that ended on this instance


@dataclasses.dataclass
class RolloutReport:
    policy: str
    num_instances: int
    num_groups: int
    num_responses: int
    output_tokens: int
    makespan_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    latency_max_s: float
    tail_s: float
    instances: list[InstanceReport]
    preemptions: int
    migrations: int
    chunks: int
    reprefill_tokens: int
    kv_bytes_imported: int
    kv_bytes_exported: int
    kv_pool_bytes_moved: int | None
    kv_pool_evictions: int | None
    spec_proposed: int
    spec_accepted: int
    length_icc: float | None
    top10_token_share: float
    mean_output_len: float
    max_output_len: int
    truncated_fraction: float
    lost_instances: list[int]
    # seer's fitted length model at the end of the rollout (mu, tau, sigma, eps, icc), or None
    length_model: dict[str, float] | None = None
    # decode steps summed over requests (each emits one token plus its accepted drafts)
    decode_steps: int = 0
    # chunks put back in the buffer because their instance was lost
    redispatched_chunks: int = 0
    # KV pool transfer rate (bytes moved / transfer time, GB/s) where the pool measures it
    kv_pool_transfer_gbps: float | None = None
    # chunks that re-prefilled their context because its KV was not in the pool (evicted, or
    # lost with the instance that wrote it), and of those reads, the ones lost with their writer
    reprefill_chunks: int = 0
    kv_pool_lost_blobs: int | None = None
    # instances that joined during the rollout to replace lost ones
    replacement_instances: list[int] = dataclasses.field(default_factory=list)
    # responses restored finished from a resumed journal (returned as recorded, not generated in
    # this run: the times and counters above cover only what this run generated)
    restored_responses: int = 0
    # the distributed draft service (grouped speculation on Ray): shards lost and rebuilt, and
    # its replicas' sync counters; None elsewhere
    draft_service: dict[str, Any] | None = None
    # instances the deployment is configured with, when a backend started it with more than
    # this rollout ran on (some were lost before it); None: all of them ran
    configured_instances: int | None = None

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else None

    @property
    def accepted_per_decode_step(self) -> float | None:
        """Mean accepted draft tokens per sequence decode step (None: no decode step)."""
        return self.spec_accepted / self.decode_steps if self.decode_steps else None

    @property
    def mean_busy_fraction(self) -> float:
        return float(np.mean([i.busy_fraction for i in self.instances])) if self.instances else 0.0

    def summary(self) -> dict[str, Any]:
        """Headline numbers, snake_case (the JSON `summary` object)."""
        return {
            "policy": self.policy,
            "tokens_per_s": self.tokens_per_s,
            "makespan_s": self.makespan_s,
            "tail_s": self.tail_s,
            "latency_p50_s": self.latency_p50_s,
            "latency_p90_s": self.latency_p90_s,
            "latency_p99_s": self.latency_p99_s,
            "latency_max_s": self.latency_max_s,
            "output_tokens": self.output_tokens,
            "num_responses": self.num_responses,
            "mean_busy_fraction": self.mean_busy_fraction,
            "preemptions": self.preemptions,
            "migrations": self.migrations,
            "kv_pool_bytes_moved": self.kv_pool_bytes_moved,
            "spec_acceptance": self.spec_acceptance,
            "length_icc": self.length_icc,
            "top10_token_share": self.top10_token_share,
            "length_model_icc": None if self.length_model is None else self.length_model["icc"],
            "lost_instances": len(self.lost_instances),
            "redispatched_chunks": self.redispatched_chunks,
            "reprefill_chunks": self.reprefill_chunks,
            "kv_pool_lost_blobs": self.kv_pool_lost_blobs,
            "replacement_instances": len(self.replacement_instances),
            "configured_instances": self.configured_instances,
            "kv_pool_transfer_gbps": self.kv_pool_transfer_gbps,
            "draft_shards_lost": None if self.draft_service is None else self.draft_service["lost_shards"],
            "draft_shards_rebuilt": (None if self.draft_service is None
                                     else self.draft_service["rebuilt_shards"]),
        }

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec_acceptance"] = self.spec_acceptance
        d["mean_busy_fraction"] = self.mean_busy_fraction
        return {"summary": self.summary(), "report": d}


def build_report(results, controller, driver, pool=None) -> RolloutReport:
    """Assemble the report from a finished rollout (`Controller`, its driver, the KV pool)."""
    lengths = np.array([r.num_tokens for r in results], dtype=np.float64)
    gidx = [r.group_index for r in results]
    finish = np.array([r.finished_at for r in results], dtype=np.float64)
    lat = np.array([r.latency_s for r in results], dtype=np.float64)
    makespan = float(finish.max()) if len(finish) else 0.0
    tokens = int(lengths.sum())
    insts = []
    for tl in driver.timelines:
        busy = min(tl.busy_s, makespan) if makespan > 0 else 0.0
        frac = busy / makespan if makespan > 0 else 0.0
        insts.append(
            InstanceReport(
                instance_id=tl.instance_id,
                busy_s=tl.busy_s,
                busy_fraction=frac,
                idle_fraction=1.0 - frac,
                steps=tl.steps,
                last_busy_at=tl.last_busy_at,
                lost_at=tl.lost_at,
                chunks=tl.chunks,
            )
        )
    pool_moved = pool_evictions = pool_gbps = pool_lost = None
    if pool is not None and hasattr(pool, "stats"):
        ps = pool.stats()
        pool_moved = int(ps.bytes_moved)
        pool_evictions = int(ps.evictions)
        pool_gbps = getattr(ps, "transfer_gbps", None)
        pool_lost = getattr(ps, "lost", None)
    st = controller.stats
    pct = lambda q: float(np.percentile(lat, q)) if len(lat) else 0.0
    return RolloutReport(
        policy=controller.policy.name,
        num_instances=len(controller.instances),
        num_groups=len(controller.groups),
        num_responses=len(results),
        output_tokens=tokens,
        makespan_s=makespan,
        tokens_per_s=tokens / makespan if makespan > 0 else 0.0,
        latency_p50_s=pct(50),
        latency_p90_s=pct(90),
        latency_p99_s=pct(99),
        latency_max_s=float(lat.max()) if len(lat) else 0.0,
        tail_s=tail_time(finish),
        instances=insts,
        preemptions=st.preemptions,
        migrations=st.migrations,
        chunks=st.chunks,
        reprefill_tokens=st.reprefill_tokens,
        kv_bytes_imported=st.kv_bytes_imported,
        kv_bytes_exported=st.kv_bytes_exported,
        kv_pool_bytes_moved=pool_moved,
        kv_pool_evictions=pool_evictions,
        spec_proposed=st.spec_proposed,
        spec_accepted=st.spec_accepted,
        decode_steps=st.decode_steps,
        length_icc=length_icc(lengths, gidx),
        top10_token_share=top_share(lengths),
        mean_output_len=float(lengths.mean()) if len(lengths) else 0.0,
        max_output_len=int(lengths.max()) if len(lengths) else 0,
        truncated_fraction=float(np.mean([r.finish_reason == "length" for r in results])),
        lost_instances=list(st.lost_instances),
        redispatched_chunks=st.redispatched_chunks,
        kv_pool_transfer_gbps=pool_gbps,
        reprefill_chunks=st.reprefill_chunks,
        kv_pool_lost_blobs=pool_lost,
        replacement_instances=list(st.replacement_instances),
        restored_responses=getattr(controller, "restored", 0),
        length_model=(None if getattr(controller.policy, "length_params", None) is None
                      else controller.policy.length_params.to_json()),
    )


def compare_summary(
    reports: Mapping[str, RolloutReport], baseline: str = "group_round_robin"
) -> dict[str, dict[str, Any]]:
    """Per policy: tokens_per_s, makespan_s, tail_s and ratios against `baseline`:
    `tokens_per_s_ratio_vs_<baseline>`, `makespan_ratio_vs_<baseline>`,
    `tail_reduction_vs_<baseline>` (1 - tail / baseline tail, clipped to 0..1)."""
    base = reports.get(baseline)
    out: dict[str, dict[str, Any]] = {}
    for name, rep in reports.items():
        row: dict[str, Any] = {
            "tokens_per_s": rep.tokens_per_s,
            "makespan_s": rep.makespan_s,
            "tail_s": rep.tail_s,
            "length_icc": rep.length_icc,
            "top10_token_share": rep.top10_token_share,
        }
        if base is not None:
            row[f"tokens_per_s_ratio_vs_{baseline}"] = (
                rep.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else None
            )
            row[f"makespan_ratio_vs_{baseline}"] = (
                rep.makespan_s / base.makespan_s if base.makespan_s > 0 else None
            )
            row[f"tail_reduction_vs_{baseline}"] = (
                min(1.0, max(0.0, 1.0 - rep.tail_s / base.tail_s)) if base.tail_s > 0 else None
            )
        out[name] = row
    return out


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def report_table(report: RolloutReport):
    """A rich Table of one report."""
    from rich.table import Table

    t = Table(title=f"rollout: policy={report.policy}, {report.num_instances} instances, "
              f"{report.num_groups} groups, {report.num_responses} responses")
    t.add_column("metric", no_wrap=True)
    t.add_column("value", justify="right")
    rows = [
        ("output tokens", f"{report.output_tokens}"),
        ("output tokens/s", f"{report.tokens_per_s:.1f}"),
        ("makespan", f"{report.makespan_s:.3f} s"),
        ("tail time (last 10%)", f"{report.tail_s:.3f} s"),
        ("latency p50/p90/p99/max", f"{report.latency_p50_s:.3f} / {report.latency_p90_s:.3f} / "
         f"{report.latency_p99_s:.3f} / {report.latency_max_s:.3f} s"),
        ("busy fraction per instance", " ".join(f"{i.busy_fraction:.2f}" for i in report.instances)),
        ("idle fraction per instance", " ".join(f"{i.idle_fraction:.2f}" for i in report.instances)),
        ("preemptions", f"{report.preemptions}"),
        ("migrations", f"{report.migrations}"),
        ("chunks", f"{report.chunks}"),
        ("re-prefilled tokens (chunks)", f"{report.reprefill_tokens} ({report.reprefill_chunks})"),
        ("KV pool bytes moved", _fmt_bytes(report.kv_pool_bytes_moved)
         + ("" if report.kv_pool_transfer_gbps is None
            else f" at {report.kv_pool_transfer_gbps:.2f} GB/s")),
        ("spec acceptance", "off" if report.spec_acceptance is None else f"{report.spec_acceptance:.3f}"),
        ("length ICC (log)", "-" if report.length_icc is None else f"{report.length_icc:.3f}"),
        ("tokens in longest 10%", f"{report.top10_token_share:.1%}"),
        ("mean / max length", f"{report.mean_output_len:.1f} / {report.max_output_len}"),
        ("truncated (hit max_tokens)", f"{report.truncated_fraction:.1%}"),
    ]
    if report.configured_instances is not None:
        rows.append(("fewer instances than configured",
                     f"{report.num_instances} of {report.configured_instances} at the start"))
    if report.lost_instances:
        rows.append(("lost instances", str(report.lost_instances)))
        rows.append(("re-dispatched chunks", str(report.redispatched_chunks)))
    if report.kv_pool_lost_blobs:
        rows.append(("KV blobs lost with their writer", str(report.kv_pool_lost_blobs)))
    if report.replacement_instances:
        served = {i.instance_id: i.chunks for i in report.instances}
        rows.append(("replacement instances (chunks)", ", ".join(
            f"{i} ({served.get(i, 0)})" for i in report.replacement_instances)))
    for k, v in rows:
        t.add_row(k, v)
    return t


def comparison_table(reports: Mapping[str, RolloutReport], baseline: str = "group_round_robin"):
    """A rich Table comparing policies against `baseline`."""
    from rich.table import Table

    summ = compare_summary(reports, baseline)
    t = Table(title=f"policies vs {baseline}")
    for col in ("policy", "tokens/s", "makespan s", "tail s", "tok/s ratio", "tail cut",
                "preempt", "migr"):
        t.add_column(col, justify="right" if col != "policy" else "left", no_wrap=True)
    for name, rep in reports.items():
        row = summ[name]
        ratio = row.get(f"tokens_per_s_ratio_vs_{baseline}")
        red = row.get(f"tail_reduction_vs_{baseline}")
        t.add_row(
            name,
            f"{rep.tokens_per_s:.1f}",
            f"{rep.makespan_s:.3f}",
            f"{rep.tail_s:.3f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            "-" if red is None else f"{red:.0%}",
            str(rep.preemptions),
            str(rep.migrations),
        )
    return t


def print_report(report: RolloutReport, console=None) -> None:
    from rich.console import Console

    (console or Console()).print(report_table(report))


def wide_console(**kw):
    """A rich Console at least 100 columns wide (piped output would otherwise wrap at 80)."""
    from rich.console import Console

    return Console(width=max(100, Console(**kw).width), **kw)


def print_comparison(
    reports: Mapping[str, RolloutReport], baseline: str = "group_round_robin", console=None
) -> None:
    from rich.console import Console

    (console or Console()).print(comparison_table(reports, baseline))


def report_from_json(d: Mapping[str, Any]) -> RolloutReport:
    """The `RolloutReport` of its `to_json()["report"]` dict (a journaled report)."""
    known = {f.name for f in dataclasses.fields(RolloutReport)}
    kw = {k: v for k, v in d.items() if k in known}
    kw["instances"] = [InstanceReport(**i) for i in kw.get("instances", [])]
    return RolloutReport(**kw)
