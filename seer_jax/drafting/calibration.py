"""Measured per-position acceptance of grouped drafts: the file `benchmarks/drafting.py
--calibration-out` writes and `seer-jax simulate --config.spec.calibration=FILE` reads.

Per-position conditional acceptance β[j] = P(draft position j accepted | positions < j were),
j = 1..gamma_max, measured on a replay of recorded group rollouts, in two forms:

- `offered`: over the drafts that offered position j (what `AcceptanceStats` measures online:
  a drafter that drafts only where it has a match, and short drafts where it is unsure);
- `per_step`: over every step, a position the drafter did not offer counting as not accepted,
  i.e. Π_{i≤j} β[i] = P(at least j draft tokens accepted) per step. A model that drafts γ tokens
  for every request (the simulator's) gets exactly the replay's accepted tokens per step from
  these; it pays for the positions the real drafter would not have offered, so it is the
  cautious side. The simulator uses `per_step`.

Both for `solo` (the request's prompt and own output only) and `group` (the group's context:
prompt and every sibling's text so far), and the group's by how many siblings had finished their
responses (`buckets`: inclusive [lo, hi] ranges, hi None = no upper end).

File (JSON): {"format": FORMAT, "gamma_max", "solo": Rates, "group": Rates,
"group_by_finished": {"buckets": [[lo, hi], ...], "rates": [Rates, ...]}, "source": {...}},
Rates = {"offered": [γ floats], "per_step": [γ floats], "steps": int, "tried": [γ ints]}.
A bucket with no steps repeats the group's overall rates and says so ("empty": true).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from seer_jax.errors import ConfigError

FORMAT = "seer_jax.spec_calibration/1"
DEFAULT_BUCKETS = ((0, 0), (1, 2), (3, 5), (6, None))


def position_rates(depths: Sequence[int], accepts: Sequence[int], gamma_max: int) -> dict:
    """Per-position conditional acceptance from per-step draft depths (0 = no draft) and accepted
    lengths (see the module docstring for `offered` and `per_step`)."""
    d = np.minimum(np.asarray(depths, np.int64), gamma_max)
    a = np.minimum(np.asarray(accepts, np.int64), d)
    pos = np.arange(1, gamma_max + 1)[:, None]  # [γ, 1]
    offered = (d[None, :] >= pos)  # position j offered
    reached = (a[None, :] >= pos - 1)  # positions < j accepted
    accepted = (a[None, :] >= pos)
    tried = (offered & reached).sum(axis=1)  # offered and reached: this position was verified
    acc = accepted.sum(axis=1)
    steps = int(d.size)
    # per step: P(acc >= j) / P(acc >= j-1), over all steps
    at_least = np.concatenate([[steps], acc]).astype(np.float64)
    per_step = np.divide(at_least[1:], at_least[:-1], out=np.zeros(gamma_max),
                         where=at_least[:-1] > 0)
    off = np.divide(acc.astype(np.float64), tried, out=np.zeros(gamma_max), where=tried > 0)
    return {"offered": [round(float(x), 6) for x in off],
            "per_step": [round(float(x), 6) for x in per_step],
            "steps": steps, "tried": [int(x) for x in tried]}


def bucket_of(finished: int, buckets: Sequence[tuple[int, int | None]]) -> int:
    """Index of the bucket holding `finished` (the last one when none does)."""
    for i, (lo, hi) in enumerate(buckets):
        if finished >= lo and (hi is None or finished <= hi):
            return i
    return len(buckets) - 1


def build_calibration(solo: tuple[Sequence[int], Sequence[int]],
                      group: tuple[Sequence[int], Sequence[int], Sequence[int]],
                      gamma_max: int,
                      buckets: Sequence[tuple[int, int | None]] = DEFAULT_BUCKETS,
                      source: dict | None = None) -> dict:
    """The calibration JSON object. `solo`: (depths, accepts) per step of the own-context
    drafter; `group`: (depths, accepts, finished siblings) per step of the group drafter."""
    gd, ga, gf = (np.asarray(x, np.int64) for x in group)
    overall = position_rates(gd, ga, gamma_max)
    which = np.asarray([bucket_of(int(f), buckets) for f in gf], np.int64)
    per_bucket = []
    for i in range(len(buckets)):
        m = which == i
        if m.any():
            per_bucket.append(position_rates(gd[m], ga[m], gamma_max))
        else:
            per_bucket.append({**overall, "steps": 0, "empty": True})
    return {
        "format": FORMAT,
        "gamma_max": int(gamma_max),
        "solo": position_rates(*solo, gamma_max),
        "group": overall,
        "group_by_finished": {"buckets": [[int(lo), hi] for lo, hi in buckets],
                              "rates": per_bucket},
        "source": dict(source or {}),
    }


@dataclasses.dataclass(frozen=True)
class SpecCalibration:
    """The rates a simulator uses (`per_step`): `solo` [γ], `group` [γ] and per bucket of
    finished siblings `by_finished` [n_buckets][γ]."""

    path: str
    gamma_max: int
    solo: tuple[float, ...]
    group: tuple[float, ...]
    buckets: tuple[tuple[int, int | None], ...]
    by_finished: tuple[tuple[float, ...], ...]

    def rates_for(self, finished_siblings: int) -> tuple[float, ...]:
        return self.by_finished[bucket_of(finished_siblings, self.buckets)]

    @classmethod
    def load(cls, path: str | pathlib.Path, key: str = "spec.calibration") -> SpecCalibration:
        """Read and check a calibration file; any problem is a ConfigError naming `key`."""
        p = pathlib.Path(path)

        def bad(why: str) -> ConfigError:
            return ConfigError(f"config.{key}={str(path)!r} is invalid: {why}")

        if not p.is_file():
            raise bad("no such file")
        try:
            d = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"not a JSON file ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise bad(f"not a calibration file (expected \"format\": {FORMAT!r}; write one with "
                      "benchmarks/drafting.py --calibration-out)")

        def rates(obj, where: str) -> tuple[float, ...]:
            r = obj.get("per_step") if isinstance(obj, dict) else None
            if (not isinstance(r, list) or not r or not all(
                    isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                    and 0 <= x <= 1 for x in r)):
                raise bad(f"{where}.per_step must be a non-empty list of rates in [0, 1]")
            return tuple(float(x) for x in r)

        solo = rates(d.get("solo"), "solo")
        group = rates(d.get("group"), "group")
        gb = d.get("group_by_finished")
        if not isinstance(gb, dict):
            raise bad("group_by_finished is missing")
        raw_b, raw_r = gb.get("buckets"), gb.get("rates")
        if (not isinstance(raw_b, list) or not raw_b or not isinstance(raw_r, list)
                or len(raw_r) != len(raw_b)):
            raise bad("group_by_finished needs as many rates as buckets (at least one)")
        buckets = []
        for b in raw_b:
            if (not isinstance(b, list) or len(b) != 2 or not isinstance(b[0], int)
                    or b[0] < 0 or not (b[1] is None or (isinstance(b[1], int)
                                                        and b[1] >= b[0]))):
                raise bad(f"group_by_finished.buckets: {b!r} is not [lo, hi|null]")
            buckets.append((int(b[0]), None if b[1] is None else int(b[1])))
        by = tuple(rates(r, f"group_by_finished.rates[{i}]") for i, r in enumerate(raw_r))
        gamma = d.get("gamma_max")
        if not isinstance(gamma, int) or gamma < 1:
            raise bad("gamma_max must be an int >= 1")
        return cls(str(path), gamma, solo, group, tuple(buckets), by)


def write_calibration(path: str | pathlib.Path, calibration: dict) -> None:
    pathlib.Path(path).write_text(json.dumps(calibration, indent=1) + "\n")
