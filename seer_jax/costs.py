"""Step-time cost models for simulated instances.

Two models share one interface, `step_time(batch_size, num_prefill_tokens, num_decode_tokens,
kv_tokens_read) -> seconds` (the function `sim.instance.SimulatedInstance` takes):

- `RooflineCostModel`: a roofline of one mesh slice (an instance). A step reads the weights it
  touches plus the KV it attends over from HBM, and does 2·active_params FLOPs per token plus the
  attention FLOPs; its time is the larger of bytes / HBM bandwidth and FLOPs / peak (each derated
  by an achievable fraction), plus a fixed per-step overhead and a small per-sequence overhead.
  Accelerator presets are per chip; a slice has `chips` of them.
- `ProfileCostModel`: calibrated from a step-time profile measured on the real engine
  (`seer-jax bench --profile`), see `StepProfile` for the JSON schema.

Speculative decoding: a step that verifies `gamma` draft tokens for each of B sequences feeds
B·(1+gamma) query tokens, each attending over its sequence's context, so
`spec_step_time(B, gamma, kv) = step_time(B, 0, B·(1+gamma), kv)` (kv = context tokens summed over
the batch, read once per step, not once per query).

KV capacity: `kv_capacity_pages()` = (HBM of the slice × memory_utilization − weights stored) /
(page_size × KV bytes per token × kv_replicas).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Sequence

import numpy as np

from seer_jax.errors import ConfigError

GIB = 1024**3


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AcceleratorSpec:
    """One chip: dense bf16 peak FLOP/s, HBM bandwidth (bytes/s) and HBM capacity (bytes)."""

    name: str
    peak_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float


# Public datasheet numbers (dense bf16, no sparsity).
ACCELERATORS: dict[str, AcceleratorSpec] = {
    "tpu-v5e": AcceleratorSpec("tpu-v5e", 197e12, 819e9, 16 * GIB),
    "tpu-v5p": AcceleratorSpec("tpu-v5p", 459e12, 2765e9, 95 * GIB),
    "tpu-v6e": AcceleratorSpec("tpu-v6e", 918e12, 1640e9, 32 * GIB),
    "h100": AcceleratorSpec("h100", 989e12, 3350e9, 80 * GIB),
    "h800": AcceleratorSpec("h800", 989e12, 3350e9, 80 * GIB),
    "h200": AcceleratorSpec("h200", 989e12, 4800e9, 141 * GIB),
}


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


_ACCEL_ALIASES = {"v5e": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e", "v5litepod": "tpu-v5e"}


def get_accelerator(name: str) -> AcceleratorSpec:
    key = _norm(name)
    key = _ACCEL_ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ConfigError(
            f"unknown accelerator {name!r}; known: {sorted(ACCELERATORS)} "
            "(or give peak_flops/hbm_gbps/hbm_gib explicitly)"
        )
    return ACCELERATORS[key]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What a step costs per token for one model.

    `shared_params` are the parameters every token uses (attention, embeddings, dense FFNs and
    shared experts); for a dense model it equals `total_params`. The routed experts hold the rest,
    of which a token activates `active_params - shared_params`. `kv_elems_per_layer` is the number
    of cached elements per token per layer (2·kv_heads·head_dim for GQA, the latent width for MLA).
    Attention FLOPs use `num_q_heads · attn_head_dim` per (query, key) pair per layer.
    """

    name: str
    total_params: float
    active_params: float
    shared_params: float
    num_layers: int
    num_q_heads: int
    attn_head_dim: int
    kv_elems_per_layer: int
    bytes_per_param: float = 2.0
    kv_bytes_per_elem: float = 2.0

    @property
    def is_moe(self) -> bool:
        return self.total_params > self.active_params

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * self.kv_elems_per_layer * self.kv_bytes_per_elem


def _gqa(kv_heads: int, head_dim: int) -> int:
    return 2 * kv_heads * head_dim


MODELS: dict[str, ModelSpec] = {
    # Llama family (GQA).
    "smollm2-135m": ModelSpec("smollm2-135m", 134.5e6, 134.5e6, 134.5e6, 30, 9, 64, _gqa(3, 64)),
    "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 8.03e9, 8.03e9, 32, 32, 128, _gqa(8, 128)),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 7.62e9, 7.62e9, 7.62e9, 28, 28, 128, _gqa(4, 128)),
    "qwen2-vl-72b": ModelSpec("qwen2-vl-72b", 72.7e9, 72.7e9, 72.7e9, 80, 64, 128, _gqa(8, 128)),
    # DeepSeek-V3-style MoE with MLA: the cache holds a 512-wide latent + 64 RoPE dims per layer;
    # attention runs in the absorbed form over 576-wide keys.
    "moonlight-16b-a3b": ModelSpec(
        "moonlight-16b-a3b", 16.0e9, 3.0e9, 1.6e9, 27, 16, 576, 576
    ),
    "kimi-k2": ModelSpec("kimi-k2", 1.04e12, 32.6e9, 11.5e9, 61, 64, 576, 576),
}

_MODEL_ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "llama3-8b": "llama-3-8b",
    "qwen2.5-7b-instruct": "qwen2.5-7b",
    "moonlight": "moonlight-16b-a3b",
    "qwen2-vl-72b-instruct": "qwen2-vl-72b",
    "kimi-k2-instruct": "kimi-k2",
    "kimi-k2-1t-a32b": "kimi-k2",
}


def get_model(name: str) -> ModelSpec:
    key = _norm(name)
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    return MODELS[key]


# ----------------------------------------------------------------------------------------------
# Roofline
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    """Roofline step time of one instance (a slice of `chips` chips).

    expert_parallel: the routed experts are sharded over this many instances that step together
      (DP-attention + EP, e.g. Kimi-K2 over 256 GPUs): each instance stores and reads 1/ep of the
      experts, touched by ep × its own batch. 1 = each instance holds the whole model.
    kv_replicas: copies of the KV cache inside the slice (MLA under tensor parallelism replicates
      the latent on every rank): divides capacity and multiplies KV bytes read.
    mfu / mbu: achievable fraction of peak FLOP/s and of HBM bandwidth.
    """

    model: ModelSpec
    accelerator: AcceleratorSpec
    chips: int = 1
    expert_parallel: int = 1
    kv_replicas: int = 1
    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 2e-3
    per_seq_overhead_s: float = 5e-6
    memory_utilization: float = 0.9
    page_size: int = 16
    pool_bytes_per_s: float = 20e9

    def __post_init__(self) -> None:
        checks = [
            ("chips", self.chips, self.chips >= 1, ">= 1"),
            ("expert_parallel", self.expert_parallel, self.expert_parallel >= 1, ">= 1"),
            ("kv_replicas", self.kv_replicas, self.kv_replicas >= 1, ">= 1"),
            ("mfu", self.mfu, 0 < self.mfu <= 1, "in (0, 1]"),
            ("mbu", self.mbu, 0 < self.mbu <= 1, "in (0, 1]"),
            ("step_overhead_s", self.step_overhead_s, self.step_overhead_s >= 0, ">= 0"),
            ("per_seq_overhead_s", self.per_seq_overhead_s, self.per_seq_overhead_s >= 0, ">= 0"),
            ("memory_utilization", self.memory_utilization, 0 < self.memory_utilization <= 1,
             "in (0, 1]"),
            ("page_size", self.page_size, self.page_size >= 1, ">= 1"),
            ("pool_bytes_per_s", self.pool_bytes_per_s, self.pool_bytes_per_s > 0, "> 0"),
            ("accelerator.peak_flops", self.accelerator.peak_flops,
             self.accelerator.peak_flops > 0, "> 0"),
            ("accelerator.hbm_bytes_per_s", self.accelerator.hbm_bytes_per_s,
             self.accelerator.hbm_bytes_per_s > 0, "> 0"),
            ("accelerator.hbm_bytes", self.accelerator.hbm_bytes,
             self.accelerator.hbm_bytes > 0, "> 0"),
        ]
        for key, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"cost model {key}={value!r} is invalid: must be {allowed}")

    # -- bytes and flops ------------------------------------------------------------------------

    @property
    def _expert_params(self) -> float:
        return self.model.total_params - self.model.shared_params

    def weight_bytes_stored(self) -> float:
        """Weight bytes held by this instance (all its chips together)."""
        m = self.model
        return (m.shared_params + self._expert_params / self.expert_parallel) * m.bytes_per_param

    def weight_bytes_read(self, num_tokens: float) -> float:
        """Weight bytes one step reads for `num_tokens` tokens of this instance.

        Dense: all weights. MoE: shared weights plus the expected fraction of the (locally stored)
        routed experts touched by the EP group's tokens, 1 − (1 − a)^tokens with a the fraction
        of routed parameters one token activates (uniform routing).
        """
        m = self.model
        if not m.is_moe or self._expert_params <= 0:
            return m.total_params * m.bytes_per_param
        frac = (m.active_params - m.shared_params) / self._expert_params
        tokens = max(num_tokens, 0.0) * self.expert_parallel
        touched = 1.0 - (1.0 - frac) ** tokens
        return (m.shared_params + touched * self._expert_params / self.expert_parallel) * (
            m.bytes_per_param
        )

    def step_flops(self, batch_size: int, num_tokens: float, kv_tokens_read: float) -> float:
        m = self.model
        dense = 2.0 * m.active_params * num_tokens
        # Each query token attends over its sequence's context: num_tokens / batch_size queries per
        # sequence, each over (on average) kv_tokens_read / batch_size keys.
        q_per_seq = num_tokens / max(batch_size, 1)
        pairs = kv_tokens_read * q_per_seq
        attn = 4.0 * m.num_layers * m.num_q_heads * m.attn_head_dim * pairs
        return dense + attn

    def step_bytes(self, num_tokens: float, kv_tokens_read: float) -> float:
        kv = kv_tokens_read * self.model.kv_bytes_per_token * self.kv_replicas
        return self.weight_bytes_read(num_tokens) + kv

    # -- the interface ---------------------------------------------------------------------------

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
        acc = self.accelerator
        t_mem = self.step_bytes(num_tokens, kv_tokens_read) / (
            acc.hbm_bytes_per_s * self.mbu * self.chips
        )
        t_flop = self.step_flops(batch_size, num_tokens, kv_tokens_read) / (
            acc.peak_flops * self.mfu * self.chips
        )
        return self.step_overhead_s + self.per_seq_overhead_s * batch_size + max(t_mem, t_flop)

    __call__ = step_time

    def spec_step_time(self, batch_size: int, gamma: int, kv_tokens_read: int) -> float:
        """A decode step verifying `gamma` draft tokens per sequence (gamma 0 = plain decode)."""
        return self.step_time(batch_size, 0, batch_size * (1 + gamma), kv_tokens_read)

    def kv_transfer_time(self, num_tokens: int) -> float:
        """Seconds to move `num_tokens` tokens of KV between this instance and the global pool."""
        return num_tokens * self.model.kv_bytes_per_token / self.pool_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        free = (
            self.accelerator.hbm_bytes * self.chips * self.memory_utilization
            - self.weight_bytes_stored()
        )
        if free <= 0:
            raise ConfigError(
                f"model {self.model.name} ({self.weight_bytes_stored() / GIB:.1f} GiB of weights "
                f"per instance) does not fit in {self.chips} x {self.accelerator.name} at "
                f"memory_utilization={self.memory_utilization}: raise chips_per_instance or "
                "expert_parallel"
            )
        return int(free // (self.model.kv_bytes_per_token * self.kv_replicas))

    def kv_capacity_pages(self) -> int:
        return self.kv_capacity_tokens() // self.page_size

    def describe(self) -> dict:
        return {
            "kind": "roofline",
            "model": self.model.name,
            "accelerator": self.accelerator.name,
            "chips": self.chips,
            "expert_parallel": self.expert_parallel,
            "kv_bytes_per_token": self.model.kv_bytes_per_token,
            "weight_gib_per_instance": self.weight_bytes_stored() / GIB,
            "kv_capacity_tokens": self.kv_capacity_tokens(),
            "decode_step_s_b1": self.spec_step_time(1, 0, 1024),
            "decode_step_s_b64": self.spec_step_time(64, 0, 64 * 8192),
        }


# ----------------------------------------------------------------------------------------------
# Calibrated mode: a measured step-time profile
# ----------------------------------------------------------------------------------------------

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
