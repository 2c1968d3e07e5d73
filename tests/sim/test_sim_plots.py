"""Plots: files exist, are PNGs, and the timeline binning is right."""

import numpy as np
import pytest

from seer_jax.sim import plots


def _png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000  # a drawn figure, not an empty canvas


def test_bin_timeline_busy_and_batch():
    steps = np.array([[0, 0.0, 1.0, 4], [0, 1.0, 2.0, 8], [1, 2.5, 3.0, 2]])
    edges, busy, batch = plots.bin_timeline(steps, num_instances=2, end_s=4.0, num_bins=4)
    assert edges.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert busy[0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert busy[1].tolist() == [0.0, 0.0, 0.5, 0.0]
    assert batch[0, :2].tolist() == [4.0, 8.0] and batch[1, 2] == 2.0 and batch[1, 0] == 0.0
    # a step spanning bins splits its time
    edges, busy, batch = plots.bin_timeline(np.array([[0, 0.5, 2.5, 3]]), 1, 4.0, 4)
    assert busy[0].tolist() == pytest.approx([0.5, 1.0, 0.5, 0.0])


def test_all_plots_write_pngs(tmp_path):
    rng = np.random.default_rng(0)
    steps = []
    for inst in range(40):
        t = 0.0
        end = rng.uniform(5, 10)
        while t < end:
            d = rng.uniform(0.05, 0.2)
            steps.append((inst, t, t + d, rng.integers(1, 64)))
            t += d
    p = plots.plot_instance_timelines(np.array(steps), 40, 10.0, tmp_path / "tl.png", max_rows=16)
    _png(p)
    _png(plots.plot_latency_cdf({"a": rng.uniform(0, 5, 100), "b": rng.uniform(0, 9, 100)},
                                tmp_path / "cdf.png"))
    _png(plots.plot_tokens_in_flight({"a": (np.arange(10), rng.integers(0, 9, 10))},
                                     tmp_path / "sub" / "tif.png"))
    _png(plots.plot_bars({"divided": 1.0, "+context": 1.5, "+spec": 1.9}, tmp_path / "ab.png",
                         ylabel="tokens/s"))
    _png(plots.plot_sweep([0.0, 0.5, 0.9], [0.8, 1.2],
                          {"group_round_robin": np.ones((2, 3)), "request_fcfs": np.ones((2, 3))},
                          tmp_path / "sweep.png"))
