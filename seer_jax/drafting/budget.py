"""Adaptive speculation budget (Seer's Algorithm 1, marginal-benefit-aware).

Per engine step with B running requests:

1. expected accepted tokens of a γ-token chain, from per-position acceptance rates β[i] (the
   probability that draft position i is accepted given positions < i were), measured online as an
   exponential moving average:  E(γ) = Σ_{j≤γ} Π_{i≤j} β[i];
2. γ* = argmin_{0≤γ≤γ_max} T_SD(B, γ),  T_SD(B, γ) = T(B, γ) / (1 + E(γ))  — step time per
   generated token, with T(B, γ) the step time verifying γ draft tokens for each of B sequences
   (a measured profile; or, when the engine's own steps are the clock, a line fitted to the
   steps it times, `measure_steps`; else a roofline cost model);
3. total budget Γ = γ*·B draft tokens; speculation is off when Γ < B (γ* = 0);
4. trees when B is small: width k = the largest k ≤ max_width with
   T(B, k·γ*) ≤ (1 + width_slack)·T(B, γ*) (extra nodes are nearly free while the step is
   memory-bound); the budget becomes k·Γ nodes, ≤ k·γ_max per request, paths ≤ γ_max;
5. allocation: draft nodes are handed out greedily by marginal benefit
      benefit(r, node) = w_r · Π_{i≤depth} β[i] · p_r(node)
   (w_r = λ for the high-priority class, 1 otherwise; p_r = the draft's own path probability),
   i.e. the Γ most beneficial nodes, each request's share a sub-tree of its draft.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

from seer_jax.drafting.draft import Draft
from seer_jax.drafting.draft_rows import DraftRows
from seer_jax.errors import ConfigError

StepTimeFn = Callable[[int, int], float]  # T(B, γ) -> seconds


@dataclasses.dataclass(frozen=True)
class BudgetConfig:
    """gamma_max: longest draft path; priority_weight: λ of the high-priority class;
    ema_decay: weight of a new observation in the β moving averages; beta_init: β before any
    observation; relax_rate: while speculation is off (nothing observed), β drifts back toward
    beta_init by this fraction per planned step, so speculation is retried later; max_width / width_slack: multi-path trees (see module docstring);
    context_tokens: mean context per sequence assumed by the default cost model;
    default_model / default_accelerator: the roofline used when no profile is given (an engine
    replaces default_model by the model it serves, see SpeculationBudget.serve)."""

    gamma_max: int = 8
    priority_weight: float = 2.0
    ema_decay: float = 0.05
    beta_init: float = 0.5
    max_width: int = 4
    width_slack: float = 0.05
    relax_rate: float = 0.002
    context_tokens: int = 4096
    default_model: str = "qwen2.5-7b"
    default_accelerator: str = "h100"

    def validate(self) -> BudgetConfig:
        checks = [
            ("gamma_max", self.gamma_max, self.gamma_max >= 1, ">= 1"),
            ("priority_weight", self.priority_weight, self.priority_weight > 0, "> 0"),
            ("ema_decay", self.ema_decay, 0 < self.ema_decay <= 1, "in (0, 1]"),
            ("beta_init", self.beta_init, 0 <= self.beta_init <= 1, "in [0, 1]"),
            ("max_width", self.max_width, self.max_width >= 1, ">= 1"),
            ("width_slack", self.width_slack, self.width_slack >= 0, ">= 0"),
            ("relax_rate", self.relax_rate, 0 <= self.relax_rate <= 1, "in [0, 1]"),
            ("context_tokens", self.context_tokens, self.context_tokens >= 0, ">= 0"),
        ]
        for key, value, ok, allowed in checks:
            if not ok:
                raise ConfigError(f"speculation.{key}={value!r} is invalid: must be {allowed}")
        return self


class AcceptanceStats:
    """Online per-position conditional acceptance rates β[1..γ_max] (EMA)."""

    def __init__(self, gamma_max: int = 8, decay: float = 0.05, init: float = 0.5) -> None:
        self.decay = float(decay)
        self.beta = np.full((gamma_max,), float(init), np.float64)
        self.observations = np.zeros((gamma_max,), np.int64)

    def observe(self, num_positions: int, accepted: int) -> None:
        """A verified draft offered `num_positions` positions along its deepest path (tree: its
        depth) and `accepted` of them were accepted: positions 1..accepted count as accepted, the
        next one (if offered) as rejected, later ones were not tried."""
        n = min(int(num_positions), self.beta.size)
        a = min(int(accepted), n)
        tried = min(a + 1, n)
        if tried <= 0:
            return
        x = np.zeros((tried,), np.float64)
        x[:a] = 1.0
        self.beta[:tried] += self.decay * (x - self.beta[:tried])
        self.observations[:tried] += 1

    def observe_drafts(self, drafts: Sequence[Draft], accepted: Sequence[int]) -> None:
        """`observe` for each non-empty draft in turn (on Python floats: a step's drafts cost
        a few operations each, not array calls)."""
        beta, seen = self.beta.tolist(), self.observations.tolist()
        decay, size = self.decay, len(beta)
        depths = (drafts.row_depths().tolist() if isinstance(drafts, DraftRows)
                  else [d.depth if len(d) else 0 for d in drafts])
        for depth, a in zip(depths, accepted, strict=True):
            if not depth:
                continue
            n = min(depth, size)
            a = min(int(a), n)
            for i in range(min(a + 1, n)):
                beta[i] += decay * ((1.0 if i < a else 0.0) - beta[i])
                seen[i] += 1
        self.beta[:] = beta
        self.observations[:] = seen

    def relax(self, toward: float, rate: float) -> None:
        """Move β a fraction `rate` of the way back to `toward` (no observation this step)."""
        self.beta += rate * (toward - self.beta)

    def set_reach(self, reach: Sequence[float]) -> None:
        """Set β so that Π_{i≤j} β[i] = reach[j] (a non-increasing sequence in [0, 1]): the rates
        of a model that predicts acceptance instead of observing it (the simulator's)."""
        r = np.minimum(np.asarray(reach, np.float64)[: self.beta.size], 1.0)
        prev = np.concatenate([[1.0], r[:-1]])
        self.beta[: r.size] = np.divide(r, prev, out=np.zeros(r.size), where=prev > 0)

    def reach(self) -> np.ndarray:
        """float64 [γ_max]: P(position j accepted) = Π_{i≤j} β[i]."""
        return np.cumprod(self.beta)

    def expected_accepted(self, gamma: int) -> float:
        """E(γ): expected accepted tokens of a γ-token chain."""
        g = min(max(int(gamma), 0), self.beta.size)
        return float(self.reach()[:g].sum())


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The step's speculation budget (see module docstring)."""

    batch_size: int
    gamma_star: int
    total_tokens: int  # Γ·width nodes for the whole batch (0 when off)
    width: int  # 1 = chains
    max_nodes_per_request: int
    max_depth: int

    @property
    def enabled(self) -> bool:
        return self.total_tokens >= self.batch_size > 0


def default_step_time(config: BudgetConfig, model=None) -> StepTimeFn:
    """T(B, γ) of a roofline cost model (seer_jax.costs) of `model` (a ModelSpec; default: the
    configured `default_model`) on the configured accelerator, each sequence attending over
    `context_tokens`."""
    from seer_jax.costs import RooflineCostModel, get_accelerator, get_model

    cost = RooflineCostModel(model or get_model(config.default_model),
                             get_accelerator(config.default_accelerator))
    ctx = config.context_tokens

    @functools.lru_cache(maxsize=4096)  # (a pure function of (B, γ), asked every step)
    def step_time(b: int, g: int) -> float:
        return cost.spec_step_time(b, g, b * ctx)

    return step_time


class FittedStepTime:
    """T(B, γ) = a + b·B·(1 + γ), fitted to the engine's own step times (seconds against the
    tokens the step computed) by least squares over exponentially decaying weights (`decay`
    per step). Until `min_steps` steps of at least two token counts are in, `fallback`
    answers. On hardware where a step's cost grows with its tokens (a CPU, compute-bound), a
    draft token costs what a generated one does, which no accelerator roofline says."""

    def __init__(self, fallback: StepTimeFn, decay: float = 0.05, min_steps: int = 8) -> None:
        self.fallback = fallback
        self.decay = decay
        self.min_steps = min_steps
        self.steps = 0
        self._s = np.zeros(5)  # weighted sums of 1, x, y, x², x·y (x = tokens, y = seconds)
        self.a: float | None = None  # seconds per step, fitted
        self.b: float | None = None  # seconds per token, fitted

    def observe(self, num_tokens: int, seconds: float) -> None:
        x, y = float(num_tokens), float(seconds)
        self._s = (1.0 - self.decay) * self._s + np.array([1.0, x, y, x * x, x * y])
        self.steps += 1
        w, sx, sy, sxx, sxy = self._s
        var = w * sxx - sx * sx
        if self.steps < self.min_steps or var <= 1e-9 * max(w * sxx, 1.0):
            return
        b = max((w * sxy - sx * sy) / var, 0.0)
        self.a, self.b = max((sy - b * sx) / w, 0.0), b

    def __call__(self, batch_size: int, gamma: int) -> float:
        if self.a is None:
            return self.fallback(batch_size, gamma)
        return self.a + self.b * batch_size * (1 + gamma)


def profile_step_time(profile, context_tokens: int = 4096) -> StepTimeFn:
    """T(B, γ) from a measured `seer_jax.costs.StepProfile`."""
    return lambda b, g: profile.t_sd(b, g, b * context_tokens)


class SpeculationBudget:
    """Plans and allocates the per-step draft budget; `stats` holds the online β."""

    def __init__(self, step_time: StepTimeFn | None = None, config: BudgetConfig | None = None,
                 stats: AcceptanceStats | None = None) -> None:
        self.config = (config or BudgetConfig()).validate()
        self._default_step_time = step_time is None  # no profile: a roofline, see serve()
        self.step_time = step_time or default_step_time(self.config)
        c = self.config
        self.stats = stats or AcceptanceStats(c.gamma_max, c.ema_decay, c.beta_init)

    @classmethod
    def from_profile_json(cls, path: str | pathlib.Path | None,
                          config: BudgetConfig | None = None) -> SpeculationBudget:
        """From a `seer-jax bench --profile` JSON (StepProfile schema); None: cost-model default."""
        config = (config or BudgetConfig()).validate()
        if path is None:
            return cls(None, config)
        from seer_jax.costs import StepProfile

        return cls(profile_step_time(StepProfile.load(path), config.context_tokens), config)

    def serve(self, model) -> None:
        """The engine using this budget serves `model` (a `seer_jax.costs.ModelSpec`): without
        a measured profile, steps are timed by that model's roofline, not `default_model`'s."""
        if self._default_step_time:
            fitted = isinstance(self.step_time, FittedStepTime)
            self.step_time = default_step_time(self.config, model)
            if fitted:
                self.step_time = FittedStepTime(self.step_time)

    def measure_steps(self) -> None:
        """The engine's own step times are the clock (`time_model="measured"`, Ray actors):
        without a measured profile or a given step time, T(B, γ) becomes a line fitted to the
        steps the engine reports (`observe_step`), the roofline until enough are in."""
        if self._default_step_time and not isinstance(self.step_time, FittedStepTime):
            self.step_time = FittedStepTime(self.step_time)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step the engine ran: the tokens it computed and its seconds (compiles left out)."""
        if isinstance(self.step_time, FittedStepTime):
            self.step_time.observe(num_tokens, seconds)

    # -- planning --------------------------------------------------------------------------------

    def t_sd(self, batch_size: int, gamma: int) -> float:
        """Step time per generated token per sequence with γ-token chains."""
        return self.step_time(batch_size, gamma) / (1.0 + self.stats.expected_accepted(gamma))

    def optimal_gamma(self, batch_size: int) -> int:
        if batch_size <= 0:
            return 0
        costs = [self.t_sd(batch_size, g) for g in range(self.config.gamma_max + 1)]
        return int(np.argmin(costs))  # first minimum: ties prefer fewer draft tokens

    def plan(self, batch_size: int, relax: bool = True) -> BudgetPlan:
        """The step's budget. When it is off and `relax`, β drifts toward beta_init (see
        BudgetConfig.relax_rate): call once per engine step."""
        c = self.config
        g = self.optimal_gamma(batch_size)
        total = g * batch_size
        if total < batch_size or batch_size <= 0:
            if relax and batch_size > 0 and c.relax_rate > 0:
                self.stats.relax(c.beta_init, c.relax_rate)
            return BudgetPlan(batch_size, g, 0, 1, 0, 0)
        base = self.step_time(batch_size, g)
        width = 1
        for k in range(2, c.max_width + 1):
            if self.step_time(batch_size, k * g) <= (1.0 + c.width_slack) * base:
                width = k
            else:
                break
        return BudgetPlan(batch_size, g, total * width, width, c.gamma_max * width, c.gamma_max)

    # -- allocation ------------------------------------------------------------------------------

    def weights(self, priorities: Sequence[int]) -> np.ndarray:
        p = np.asarray(priorities, np.int64)
        return np.where(p > 0, self.config.priority_weight, 1.0)

    def allocate(self, drafts: Sequence[Draft], priorities: Sequence[int] | None = None,
                 plan: BudgetPlan | None = None) -> DraftRows:
        """Trim candidate drafts (one per running request, possibly empty; a list of `Draft`s
        or `DraftRows`) to the step budget: the plan's `total_tokens` most beneficial nodes,
        ≤ max_nodes_per_request and depth ≤ max_depth per request. Returns the drafts to verify
        (empty where none), as `DraftRows` (a sequence of `Draft`s)."""
        rows = DraftRows.from_drafts(drafts)
        n = len(rows)
        if priorities is None:
            priorities = [0] * n
        if plan is None:
            plan = self.plan(n)
        if not plan.enabled or not rows.num_nodes:
            return DraftRows.empty(rows.match_len)
        # every request's nodes, concatenated (request, then node order)
        dep, par = rows.depths, rows.parents
        probs = rows.probs.astype(np.float64)
        req = rows.row
        first = rows.starts[:-1]  # each request's first node
        node = np.arange(req.size) - first[req]
        reach = self.stats.reach()
        w = self.weights(priorities)
        ok = np.flatnonzero(dep <= plan.max_depth)
        benefit = w[req[ok]] * reach[np.minimum(dep[ok], reach.size) - 1] * probs[ok]
        chosen = ok[_most_beneficial(req[ok], node[ok], benefit, plan.max_nodes_per_request,
                                     plan.total_tokens)]
        # a node stays when it and all its ancestors were chosen
        picked = np.zeros(req.size, bool)
        picked[chosen] = True
        parent = np.where(par >= 0, first[req] + par, 0)
        keep = picked & (par < 0)
        for _ in range(int(dep.max()) if dep.size else 0):
            grown = picked & ((par < 0) | keep[parent])
            if (grown == keep).all():
                break
            keep = grown
        return rows.select(keep)

    def allocate_expected(self, reach: np.ndarray, priorities: Sequence[int] | None = None,
                          plan: BudgetPlan | None = None) -> np.ndarray:
        """`allocate` for a model of drafting instead of drafts: request r's chain accepts
        position j with probability reach[r, j-1] (non-increasing along j), so its benefit is
        w_r · reach[r, j-1] (the p_r(node) · Π β of a real draft). Returns int64 [B]: how many
        chain positions each request gets (a prefix of its chain), by the same greedy rule,
        ≤ max_depth per request and plan.total_tokens in all."""
        reach = np.asarray(reach, np.float64)
        b, g = reach.shape
        if plan is None:
            plan = self.plan(b)
        if not plan.enabled or g == 0:
            return np.zeros(b, np.int64)
        g = min(g, plan.max_depth)
        w = self.weights([0] * b if priorities is None else priorities)
        req = np.repeat(np.arange(b, dtype=np.int64), g)
        node = np.tile(np.arange(g, dtype=np.int64), b)
        benefit = (reach[:, :g] * w[:, None]).reshape(-1)
        chosen = _most_beneficial(req, node, benefit, plan.max_nodes_per_request,
                                  plan.total_tokens)
        keep = np.zeros(b * g, bool)
        keep[chosen] = True
        # a prefix per request: position j only with every position before it (ties)
        return np.cumprod(keep.reshape(b, g), axis=1).sum(axis=1).astype(np.int64)


def _most_beneficial(req: np.ndarray, node: np.ndarray, benefit: np.ndarray,
                     max_per_request: int, total: int) -> np.ndarray:
    """Indices of the `total` highest-benefit candidates, ≤ max_per_request per request.
    Ties: lower request, then lower node index (parents first)."""
    order = np.lexsort((node, req, -benefit))
    req_sorted = req[order]
    # rank of each candidate within its request (in benefit order)
    by_req = np.argsort(req_sorted, kind="stable")
    starts = np.searchsorted(req_sorted[by_req], req_sorted[by_req], side="left")
    rank = np.empty_like(by_req)
    rank[by_req] = np.arange(by_req.size) - starts
    return order[rank < max_per_request][:total]
