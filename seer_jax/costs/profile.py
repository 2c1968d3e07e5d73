"""The calibrated step-time model (`ProfileCostModel`): fitted to a step-time profile measured
on the real engine (`StepProfile`, written by `seer-jax bench --profile`), or sampled from another
cost model (`profile_from_cost_model`)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from seer_jax.errors import ConfigError

PROFILE_SCHEMA = "seer_jax.step_profile/v1"


@dataclasses.dataclass(frozen=True)
class ProfilePoint:
    batch_size: int
    gamma: int
    num_tokens: int
    kv_tokens: int
    step_s: float
    count: int = 1  # steps this point stands for (its weight in the fit)


@dataclasses.dataclass
class StepProfile:
    """A step-time profile measured on the real engine (`seer-jax bench --profile`).

    JSON schema (`schema` = "seer_jax.step_profile/v1"):

        {
          "schema": "seer_jax.step_profile/v1",
          "model": "smollm2-135m",            # free text, informational
          "device": "cpu x2",                 # free text, informational
          "page_size": 16,                    # optional
          "points": [                         # one per measured step configuration
            {"batch_size": 8, "gamma": 0, "num_tokens": 8, "kv_tokens": 4096, "step_s": 0.031},
            ...
          ]
        }

    `batch_size` sequences, each with `gamma` draft tokens (0 = plain decode); `num_tokens` query
    tokens in the step (default batch_size·(1+gamma); prefill chunks count their tokens);
    `kv_tokens` context tokens read, summed over the batch (default 0); `step_s` the median
    measured step time. A T(B, γ) grid is just points without prefill.

    Fit: step_s ≈ f(num_tokens) + c_kv·kv_tokens + c_seq·batch_size, with f piecewise linear over
    the distinct measured token counts (one free level per count; linear extrapolation past the
    ends, never decreasing), found by least squares with c_kv, c_seq ≥ 0.
    """

    points: list[ProfilePoint]
    model: str = ""
    device: str = ""
    page_size: int | None = None
    # how levels are made non-decreasing in num_tokens: "max" (running max: conservative, for
    # grids measured point by point) or "isotonic" (weighted least squares: for noisy steps of a
    # real run, where one slow level must not lift every larger one)
    monotone: str = "max"

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("step profile has no points")
        if self.monotone not in ("max", "isotonic"):
            raise ConfigError(f"step profile monotone={self.monotone!r}: allowed 'max', 'isotonic'")
        for i, p in enumerate(self.points):
            if p.batch_size < 1 or p.gamma < 0 or p.num_tokens < 1 or p.kv_tokens < 0:
                raise ConfigError(f"step profile point {i} is invalid: {p}")
            if not (p.step_s > 0 and math.isfinite(p.step_s)):
                raise ConfigError(f"step profile point {i} has step_s={p.step_s!r}: must be > 0")
        self._fit()

    # -- io --------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> StepProfile:
        if not isinstance(d, dict) or "points" not in d:
            raise ConfigError("step profile JSON must be an object with a 'points' list")
        schema = d.get("schema", PROFILE_SCHEMA)
        if schema != PROFILE_SCHEMA:
            raise ConfigError(f"step profile schema {schema!r} is not {PROFILE_SCHEMA!r}")
        pts = []
        for i, raw in enumerate(d["points"]):
            try:
                b = int(raw["batch_size"])
                g = int(raw.get("gamma", 0))
                pts.append(
                    ProfilePoint(
                        batch_size=b,
                        gamma=g,
                        num_tokens=int(raw.get("num_tokens", b * (1 + g))),
                        kv_tokens=int(raw.get("kv_tokens", 0)),
                        step_s=float(raw["step_s"]),
                        count=int(raw.get("count", 1)),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(
                    f"step profile point {i} ({raw!r}) needs batch_size and step_s: {e}"
                ) from None
        return cls(pts, model=str(d.get("model", "")), device=str(d.get("device", "")),
                   page_size=d.get("page_size"), monotone=str(d.get("monotone", "max")))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> StepProfile:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"step profile not found: {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"step profile {path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_steps(cls, steps, *, model: str = "", device: str = "", page_size: int | None = None,
                   kv_bucket: int = 256) -> StepProfile:
        """A profile from the steps an engine actually executed: rows of (batch_size,
        num_prefill_tokens, num_decode_tokens, kv_tokens_read, step_s) as
        `EngineInstance.step_log` records them. Steps with the same batch size, token count and
        KV bucket (`kv_bucket` tokens) become one point at their mean time (the mean, not the
        median: a rollout's makespan is a sum of step times, so occasional slow steps count)."""
        groups: dict[tuple[int, int, int], list[tuple[int, float]]] = {}
        for row in steps:
            b, n_pre, n_dec, kv, dt = row
            n = int(n_pre) + int(n_dec)
            if n < 1 or not dt > 0:
                continue
            groups.setdefault((int(b), n, int(kv) // kv_bucket), []).append((int(kv), float(dt)))
        if not groups:
            raise ConfigError("no executed steps to build a step profile from")
        pts = [
            ProfilePoint(batch_size=b, gamma=0, num_tokens=n,
                         kv_tokens=int(np.median([kv for kv, _ in rows])),
                         step_s=float(np.mean([dt for _, dt in rows])), count=len(rows))
            for (b, n, _), rows in sorted(groups.items())
        ]
        return cls(pts, model=model, device=device, page_size=page_size, monotone="isotonic")

    def to_dict(self) -> dict:
        out = {"schema": PROFILE_SCHEMA, "model": self.model, "device": self.device,
               "monotone": self.monotone,
               "points": [dataclasses.asdict(p) for p in self.points]}
        if self.page_size is not None:
            out["page_size"] = self.page_size
        return out

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    # -- fit -------------------------------------------------------------------------------------

    def _fit(self) -> None:
        n = np.array([p.num_tokens for p in self.points], dtype=np.float64)
        kv = np.array([p.kv_tokens for p in self.points], dtype=np.float64)
        b = np.array([p.batch_size for p in self.points], dtype=np.float64)
        y = np.array([p.step_s for p in self.points], dtype=np.float64)
        cnt = np.array([p.count for p in self.points], dtype=np.float64)
        w = np.sqrt(cnt)
        levels = np.unique(n)
        onehot = (n[:, None] == levels[None, :]).astype(np.float64)
        extra_cols = {"kv": kv, "seq": b}
        # Drop columns that carry no information (constant within every level) or go negative.
        use = [k for k, col in extra_cols.items() if _varies_within_levels(col, n)]
        coef = {}
        while True:
            x = np.concatenate([onehot] + [extra_cols[k][:, None] for k in use], axis=1)
            sol, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
            coef = dict(zip(use, sol[len(levels):], strict=True))
            neg = [k for k, c in coef.items() if c < 0]
            if not neg:
                break
            use = [k for k in use if k not in neg]
        # Never decreasing in num_tokens (a bigger step is never faster), see `monotone`.
        base = np.maximum(sol[: len(levels)], 0.0)
        if self.monotone == "isotonic":
            base = _isotonic(base, onehot.T @ cnt)  # weight of a level: the steps it stands for
        else:
            base = np.maximum.accumulate(base)
        self._levels = levels
        self._base = base
        self.c_kv = float(coef.get("kv", 0.0))
        self.c_seq = float(coef.get("seq", 0.0))
        if len(levels) >= 2:
            self._slope_hi = max(0.0, (base[-1] - base[-2]) / (levels[-1] - levels[-2]))
        else:
            self._slope_hi = 0.0

    def base_time(self, num_tokens: float) -> float:
        lv, bs = self._levels, self._base
        if num_tokens <= lv[0]:
            if len(lv) >= 2:
                slope = max(0.0, (bs[1] - bs[0]) / (lv[1] - lv[0]))
                return float(max(bs[0] - slope * (lv[0] - num_tokens), 0.5 * bs[0]))
            return float(bs[0])
        if num_tokens >= lv[-1]:
            return float(bs[-1] + self._slope_hi * (num_tokens - lv[-1]))
        return float(np.interp(num_tokens, lv, bs))

    def predict(self, batch_size: int, num_tokens: float, kv_tokens: float) -> float:
        return self.base_time(num_tokens) + self.c_kv * kv_tokens + self.c_seq * batch_size

    def t_sd(self, batch_size: int, gamma: int, kv_tokens: float = 0.0) -> float:
        """T(B, γ): one speculative step verifying γ drafts for each of B sequences."""
        return self.predict(batch_size, batch_size * (1 + gamma), kv_tokens)


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted non-decreasing least-squares fit of `y` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for yi, wi in zip(y, w, strict=True):
        blocks.append([float(yi), float(wi), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([np.full(n, m) for m, _, n in blocks])


def _varies_within_levels(col: np.ndarray, levels_of: np.ndarray) -> bool:
    for lv in np.unique(levels_of):
        sel = col[levels_of == lv]
        if sel.size > 1 and np.ptp(sel) > 0:
            return True
    return False


@dataclasses.dataclass
class ProfileCostModel:
    """Calibrated step times from a `StepProfile`; KV capacity and pool bandwidth given directly
    (they are properties of the deployment, not of the step)."""

    profile: StepProfile
    kv_capacity_tokens_: int
    page_size: int = 16
    pool_bytes_per_s: float = 20e9
    kv_bytes_per_token: float = 0.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens_ < self.page_size:
            raise ConfigError(f"kv capacity {self.kv_capacity_tokens_} tokens is below one page")
        if self.time_scale <= 0:
            raise ConfigError(f"time_scale={self.time_scale} must be > 0")
        if self.pool_bytes_per_s <= 0:
            raise ConfigError(f"pool_bytes_per_s={self.pool_bytes_per_s} must be > 0")

    def step_time(
        self,
        batch_size: int,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        kv_tokens_read: int,
    ) -> float:
        num_tokens = num_prefill_tokens + num_decode_tokens
        if num_tokens <= 0:
            return 0.0
        return self.time_scale * self.profile.predict(batch_size, num_tokens, kv_tokens_read)

    __call__ = step_time

    def spec_step_time(self, batch_size: int, gamma: int, kv_tokens_read: int) -> float:
        return self.step_time(batch_size, 0, batch_size * (1 + gamma), kv_tokens_read)

    def kv_transfer_time(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.pool_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_tokens_

    def kv_capacity_pages(self) -> int:
        return self.kv_capacity_tokens_ // self.page_size

    def describe(self) -> dict:
        return {
            "kind": "profile",
            "model": self.profile.model,
            "device": self.profile.device,
            "num_points": len(self.profile.points),
            "kv_capacity_tokens": self.kv_capacity_tokens_,
            "decode_step_s_b1": self.spec_step_time(1, 0, 1024),
            "decode_step_s_b64": self.spec_step_time(64, 0, 64 * 8192),
        }


def profile_from_cost_model(
    cost,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
    gammas: Sequence[int] = (0, 1, 2, 4, 8),
    context_tokens: Sequence[int] = (512, 4096, 32768),
    model: str = "",
    device: str = "roofline",
) -> StepProfile:
    """Sample a cost model on a (B, γ, context) grid: a synthetic profile with the real schema
    (for tests, and as the speculation budget's default when nothing was measured)."""
    pts = []
    for b in batch_sizes:
        for g in gammas:
            for ctx in context_tokens:
                kv = b * ctx
                pts.append(ProfilePoint(b, g, b * (1 + g), kv, cost.spec_step_time(b, g, kv)))
    return StepProfile(pts, model=model, device=device)
