"""PNG plots of simulated (or emulated) rollouts: per-instance timelines, latency CDFs,
tokens in flight over time, the ablation ladder and the ICC / tail-heaviness sweep.

Inputs are plain arrays, so the same functions draw a simulator run or a real rollout report.
A step record is (instance_id, start_s, end_s, batch_size).
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

StepRecords = np.ndarray  # float64 [num_steps, 4]: instance_id, start_s, end_s, batch_size


def bin_timeline(
    steps: StepRecords, num_instances: int, end_s: float, num_bins: int = 400
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-instance busy fraction and time-weighted mean batch size in `num_bins` time bins.

    Returns (bin_edges [num_bins+1], busy [num_instances, num_bins], batch [num_instances,
    num_bins]); batch is 0 where the instance was idle for the whole bin."""
    steps = np.asarray(steps, dtype=np.float64).reshape(-1, 4)
    end_s = max(float(end_s), 1e-9)
    edges = np.linspace(0.0, end_s, num_bins + 1)
    width = edges[1] - edges[0]
    busy = np.zeros((num_instances, num_bins))
    weighted = np.zeros((num_instances, num_bins))
    for inst, s, e, b in steps:
        i = int(inst)
        if not 0 <= i < num_instances or e <= s:
            continue
        b0 = int(min(s // width, num_bins - 1))
        b1 = int(min(e // width, num_bins - 1))
        if b0 == b1:
            busy[i, b0] += e - s
            weighted[i, b0] += (e - s) * b
            continue
        lo = np.maximum(edges[b0 : b1 + 1], s)
        hi = np.minimum(edges[b0 + 1 : b1 + 2], e)
        d = np.maximum(hi - lo, 0.0)
        busy[i, b0 : b1 + 1] += d
        weighted[i, b0 : b1 + 1] += d * b
    batch = np.where(busy > 0, weighted / np.maximum(busy, 1e-300), 0.0)
    return edges, np.clip(busy / width, 0.0, 1.0), batch


def plot_instance_timelines(
    steps: StepRecords,
    num_instances: int,
    end_s: float,
    path: str | pathlib.Path,
    title: str = "",
    max_rows: int = 64,
) -> pathlib.Path:
    """Heatmap of batch size per instance over time (white = idle) above the cluster's busy
    fraction over time. With more than `max_rows` instances an evenly spaced subset is drawn."""
    edges, busy, batch = bin_timeline(steps, num_instances, end_s)
    rows = np.arange(num_instances)
    if num_instances > max_rows:
        rows = np.unique(np.linspace(0, num_instances - 1, max_rows).round().astype(int))
    fig, (ax0, ax1) = plt.subplots(
        2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    shown = np.ma.masked_where(busy[rows] <= 0, batch[rows])
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    im = ax0.imshow(
        shown, aspect="auto", interpolation="nearest", cmap=cmap, origin="lower",
        extent=(edges[0], edges[-1], -0.5, len(rows) - 0.5),
    )
    ax0.set_ylabel("instance" + (f" ({len(rows)} of {num_instances})" if len(rows) < num_instances
                                 else ""))
    if len(rows) <= 16:
        ax0.set_yticks(range(len(rows)), [str(r) for r in rows])
    fig.colorbar(im, ax=[ax0, ax1], label="batch size (white = idle)", pad=0.01)
    centers = 0.5 * (edges[:-1] + edges[1:])
    ax1.fill_between(centers, busy.mean(axis=0), step="mid", alpha=0.6)
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("busy fraction")
    ax1.set_xlabel("time (s)")
    ax0.set_title(title or "per-instance timeline")
    return _save(fig, path)


def plot_latency_cdf(
    latencies: Mapping[str, Sequence[float]], path: str | pathlib.Path, title: str = ""
) -> pathlib.Path:
    """Empirical CDF of per-response completion latency, one line per policy."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, lat in latencies.items():
        x = np.sort(np.asarray(lat, dtype=np.float64))
        if x.size == 0:
            continue
        y = np.arange(1, x.size + 1) / x.size
        ax.step(x, y, where="post", label=name)
    ax.set_xlabel("response latency (s)")
    ax.set_ylabel("fraction of responses done")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "latency CDF")
    fig.tight_layout()
    return _save(fig, path)


def plot_tokens_in_flight(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: str | pathlib.Path,
    ylabel: str = "tokens in flight (running sequences, all instances)",
    title: str = "",
) -> pathlib.Path:
    """A step function of a cluster-wide quantity over time, one line per policy."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (t, v) in series.items():
        t = np.asarray(t, dtype=np.float64)
        v = np.asarray(v, dtype=np.float64)
        if t.size:
            ax.step(t, v, where="post", label=name, linewidth=1.0)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title or "tokens in flight")
    fig.tight_layout()
    return _save(fig, path)


def plot_bars(
    values: Mapping[str, float], path: str | pathlib.Path, ylabel: str, title: str = ""
) -> pathlib.Path:
    """Bar chart (the ablation ladder: one bar per configuration, annotated)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(values)
    vals = [float(values[n]) for n in names]
    bars = ax.bar(range(len(names)), vals, color="tab:blue")
    for b, v in zip(bars, vals, strict=True):
        ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names, rotation=12)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_sweep(
    iccs: Sequence[float],
    sigmas: Sequence[float],
    gain_vs: Mapping[str, np.ndarray],
    path: str | pathlib.Path,
    title: str = "",
    reference: Mapping[str, float] | None = None,
) -> pathlib.Path:
    """Seer's throughput gain over each baseline vs ICC, one line per tail heaviness.
    gain_vs[baseline] is [len(sigmas), len(iccs)]. `reference` ({"icc", "sigma"} of a real
    trace, `workloads.log_length_spread`): a dashed line at its ICC."""
    fig, axes = plt.subplots(1, len(gain_vs), figsize=(6 * len(gain_vs), 4.5), squeeze=False)
    for ax, (base, gain) in zip(axes[0], gain_vs.items(), strict=True):
        gain = np.asarray(gain, dtype=np.float64)
        for j, s in enumerate(sigmas):
            ax.plot(iccs, gain[j], marker="o", label=f"tail sigma={s:g}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        if reference is not None:
            ax.axvline(reference["icc"], color="black", linestyle="--", linewidth=1.0,
                       label=f"real trace: ICC {reference['icc']:.2f}, "
                             f"sigma {reference['sigma']:.2f}")
        ax.set_xlabel("intra-group length correlation (ICC, log lengths)")
        ax.set_ylabel(f"seer tokens/s ÷ {base}")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"seer vs {base}")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
