"""Seer's length estimator: a hierarchical log-normal model of output lengths, fitted online.

Model (log scale), for group g (one prompt) and response r:

    log L[g, r] = mu + a[g] + e[g, r],   a[g] ~ N(0, tau^2),
    e[g, r] ~ (1 - eps) N(0, sigma^2) + eps N(0, (WIDE sigma)^2)

`tau` is the prompt effect (between groups), `sigma` the spread among the G samples of one prompt;
tau^2 / (tau^2 + sigma^2) is the length ICC. The small wide component (`eps`, fitted) is for
runaway responses (a sample that loops until the budget): without it a response that has
outlived its siblings several times over would be predicted to stop any moment, by the thin
tail of a normal; with it, it is predicted to keep going. What the rollout has seen so far is data:
a finished response is an exact length, a response cut at `max_tokens` is censored there
(L >= max_tokens), and an unfinished one that has generated n tokens is censored at n (L > n).
Censoring matters: early in a rollout only short responses have finished, and treating them as
a sample would make every group look short.

- `fit(groups)`: the population parameters (mu, tau, sigma, eps) by maximum a posteriori on the
  censored marginal likelihood (the prompt effect integrated out on a grid), with weak priors
  that only keep the fit well posed while little has finished. Nelder-Mead, warm-started.
- `posterior(group)`: the group's prompt effect a[g] given its responses so far, as weights on
  a grid of points.
- `remaining_quantile(group, requests, q)`: per request, the q-quantile of its remaining length
  given the group posterior and its own progress: the x with P(L > x | everything seen) = 1 - q,
  minus what it has generated (at most max_tokens - generated).

Pure numpy; `log_ndtr` uses the Chebyshev erfc approximation (relative error < 1.2e-7), in log
space so far tails do not underflow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from seer_jax.errors import ConfigError

if TYPE_CHECKING:
    from seer_jax.rollout.core.policies.base import GroupState, RequestState

_SQRT2 = math.sqrt(2.0)
_LOG2 = math.log(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def log_ndtr(x: np.ndarray) -> np.ndarray:
    """log Phi(x) of the standard normal CDF, elementwise, accurate in both tails."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 0:
        return log_ndtr(x.reshape(1)).reshape(())
    z = np.abs(x)
    z /= _SQRT2
    t = 0.5 * z
    t += 1.0
    np.divide(1.0, t, out=t)
    # Horner's rule in place: the same operations, in the same order, as the nested expression
    # -1.26551223 + t * (1.00002368 + t * (... + t * 0.17087277))
    poly = t * 0.17087277
    for c in _ERFC_COEFFS:
        poly += c
        poly *= t
    poly += -1.26551223
    log_erfc = np.log(t)  # log erfc(z), z >= 0
    z *= z
    log_erfc -= z
    log_erfc += poly
    pos = np.exp(log_erfc)
    pos *= -0.5
    np.log1p(pos, out=pos)
    log_erfc -= _LOG2
    return np.where(x < 0.0, log_erfc, pos)


_ERFC_COEFFS = (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
                0.37409196, 1.00002368)


def log_sf(x: np.ndarray) -> np.ndarray:
    """log(1 - Phi(x))."""
    return log_ndtr(-np.asarray(x, dtype=np.float64))


def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.squeeze(m, axis=axis) + np.log(np.sum(np.exp(a - m), axis=axis))


@dataclasses.dataclass(frozen=True)
class LengthParams:
    """Population parameters of the log-normal length model (natural log of tokens)."""

    mu: float
    tau: float
    sigma: float
    eps: float = 0.02  # share of runaway responses (the wide within-group component)

    @property
    def icc(self) -> float:
        v = self.tau**2 + self.sigma**2
        return self.tau**2 / v if v > 0 else 0.0

    def to_json(self) -> dict:
        return {"mu": self.mu, "tau": self.tau, "sigma": self.sigma, "eps": self.eps,
                "icc": self.icc, "median_tokens": math.exp(self.mu)}


WIDE = 4.0  # the runaway component's spread, in units of sigma
_EPS_MAX = 0.15


def nelder_mead(f, x0: np.ndarray, step: float = 0.3, max_evals: int = 300,
                tol: float = 1e-5) -> tuple[np.ndarray, float]:
    """Minimise f from x0 (a small dependency-free Nelder-Mead); returns (x, f(x))."""
    n = len(x0)
    pts = [np.asarray(x0, dtype=np.float64)]
    for i in range(n):
        p = pts[0].copy()
        p[i] += step
        pts.append(p)
    vals = [f(p) for p in pts]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(vals)
        pts = [pts[i] for i in order]
        vals = [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (1.0 + abs(vals[0])):
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + (centroid - pts[-1])
        fr = f(xr)
        evals += 1
        if fr < vals[0]:
            xe = centroid + 2.0 * (centroid - pts[-1])
            fe = f(xe)
            evals += 1
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(xc)
            evals += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:  # shrink towards the best point
                for i in range(1, n + 1):
                    pts[i] = pts[0] + 0.5 * (pts[i] - pts[0])
                    vals[i] = f(pts[i])
                evals += n
    i = int(np.argmin(vals))
    return pts[i], float(vals[i])


def request_observation(req: RequestState, max_tokens: int) -> tuple[str, float] | None:
    """What a request says about its length: ("exact", log L), ("censored", log c) meaning
    L > c, or None (nothing generated yet). Unfinished requests count their running chunk's
    reported progress (`known_generated`)."""
    n = req.generated if req.status == "done" else req.known_generated
    if req.status == "done":
        if req.finish_reason == "length" or n >= max_tokens:
            return ("censored", math.log(max(1.0, max_tokens - 0.5)))
        return ("exact", math.log(max(1, n)))
    if n > 0:
        return ("censored", math.log(n + 0.5))
    return None


def _segment_sum(v: np.ndarray, seg: np.ndarray, num: int,
                 index: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Rows of v [N, K] summed by their (sorted, non-decreasing) segment ids into [num, K].
    `index`: `np.unique(seg, return_index=True)` if already known."""
    out = np.zeros((num, v.shape[1]))
    ids, starts = np.unique(seg, return_index=True) if index is None else index
    out[ids] = np.add.reduceat(v, starts, axis=0)
    return out


@dataclasses.dataclass
class _Data:
    """Observations of some groups, flattened: exact log lengths and censoring points with their
    group index, per-group exact count and sum (to place each group's quadrature)."""

    gi_e: np.ndarray
    y: np.ndarray
    gi_c: np.ndarray
    c: np.ndarray
    n_e: np.ndarray
    s1: np.ndarray
    # censoring points with the same group grid (a group's grid depends only on its exact count
    # and sum) and the same point give the same terms: computed once, at `c_first`, and spread
    # back by `c_inverse` (running siblings stand at chunk boundaries, most groups have no
    # finished response early on, so a fit sees a few distinct points among hundreds)
    c_first: np.ndarray | None = None
    c_inverse: np.ndarray | None = None
    _segments: dict = dataclasses.field(default_factory=dict)

    def segments(self, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`np.unique(seg, return_index=True)` of gi_e or gi_c, computed once (a fit sums by
        the same segments at every evaluation)."""
        key = id(seg)
        if key not in self._segments:
            self._segments[key] = (seg, np.unique(seg, return_index=True))
        return self._segments[key][1]

    @property
    def num_groups(self) -> int:
        return len(self.n_e)

    def dedupe_censored(self) -> None:
        if len(self.c) < 2:
            return
        key = np.stack([self.n_e[self.gi_c], self.s1[self.gi_c], self.c], axis=1)
        _, first, inverse = np.unique(key, axis=0, return_index=True, return_inverse=True)
        if len(first) < len(self.c):
            self.c_first, self.c_inverse = first, inverse.reshape(-1)


class GroupLengthModel:
    """The hierarchical length model of one rollout (see the module docstring).

    grid_points / grid_halfwidth: the prompt effect a[g] is integrated on `grid_points` points
    over +-`grid_halfwidth` posterior sds around its exact-length posterior mean (adaptive
    quadrature). x_points: log-length grid for quantiles. max_fit_groups: groups a fit reads.
    """

    def __init__(self, max_tokens: int, prior: LengthParams | None = None, grid_points: int = 41,
                 grid_halfwidth: float = 7.0, x_points: int = 160,
                 max_fit_groups: int = 256):
        if max_tokens < 1:
            raise ConfigError(f"max_tokens={max_tokens} must be >= 1")
        self.max_tokens = int(max_tokens)
        log_m = math.log(self.max_tokens)
        # weak default prior: median response an e-th of the budget, spreads of a factor ~2
        self.prior = prior or LengthParams(mu=max(0.0, log_m - 1.0), tau=0.7, sigma=0.7)
        self.params = self.prior
        # standardized quadrature points: a = centre + scale * u per group (see `_grid`)
        self.u = np.linspace(-grid_halfwidth, grid_halfwidth, grid_points)
        self.x = np.linspace(0.0, log_m, x_points)  # log-length grid for quantiles
        self.max_fit_groups = int(max_fit_groups)
        self.fits = 0
        # survival on the quantile grid per prompt-effect grid, for the current params: a
        # group's grid moves only when one of its responses finishes (see `_grid`)
        self._sx_params: LengthParams | None = None
        self._sx_cache: dict[bytes, np.ndarray] = {}
        # log P(log L > c) rows per (prompt-effect grid, c), for the current params: a group's
        # posterior and its requests' quantiles ask for the same rows until a request moves on
        self._sf_rows: dict[bytes, dict[float, np.ndarray]] = {}
        self._sf_count = 0

    # ---- model pieces ---------------------------------------------------------------------------
    @staticmethod
    def _log_pdf(z: np.ndarray, p: LengthParams) -> np.ndarray:
        """log density of a log length at standardized residual z = (y - mu - a) / sigma."""
        core = math.log1p(-p.eps) - 0.5 * z * z - math.log(p.sigma) - _LOG_SQRT_2PI
        wide = math.log(p.eps) - 0.5 * (z / WIDE) ** 2 - math.log(WIDE * p.sigma) - _LOG_SQRT_2PI
        return np.logaddexp(core, wide)

    @staticmethod
    def _log_sf(z: np.ndarray, p: LengthParams) -> np.ndarray:
        """log P(log L > c) at z = (c - mu - a) / sigma."""
        both = log_sf(np.stack([z, z / WIDE]))  # one call for both components
        return np.logaddexp(math.log1p(-p.eps) + both[0], math.log(p.eps) + both[1])

    def _data(self, groups: Sequence[GroupState]) -> _Data:
        gi_e, y, gi_c, c, n_e, s1 = [], [], [], [], [], []
        k = 0
        for g in groups:
            ne, a1, ce = 0, 0.0, []
            for r in g.requests:
                obs = request_observation(r, self.max_tokens)
                if obs is None:
                    continue
                kind, v = obs
                if kind == "exact":
                    ne += 1
                    a1 += v
                    gi_e.append(k)
                    y.append(v)
                else:
                    ce.append(v)
            if ne == 0 and not ce:
                continue
            n_e.append(ne)
            s1.append(a1)
            gi_c.extend([k] * len(ce))
            c.extend(ce)
            k += 1
        return _Data(np.asarray(gi_e, np.int64), np.asarray(y, np.float64),
                     np.asarray(gi_c, np.int64), np.asarray(c, np.float64),
                     np.asarray(n_e, np.float64), np.asarray(s1, np.float64))

    def _grid(self, p: LengthParams, d: _Data) -> tuple[np.ndarray, np.ndarray]:
        """[num_groups, grid] prompt-effect points per group and [num_groups] log spacing.

        Adaptive quadrature: each group's grid is centred on the (normal-approximation) posterior
        mean of a[g] given its exact lengths and scaled by that posterior's sd (the prior's when it
        has none), so a group of 8 near-identical lengths is integrated as accurately as one of 8
        scattered ones.
        """
        prec = d.n_e / p.sigma**2 + 1.0 / p.tau**2
        centre = (d.s1 - d.n_e * p.mu) / p.sigma**2 / prec
        scale = 1.0 / np.sqrt(prec)
        a = centre[:, None] + scale[:, None] * self.u[None, :]
        return a, np.log(scale * (self.u[1] - self.u[0]))

    def _group_log_joint(self, p: LengthParams, a: np.ndarray, d: _Data,
                         cached: bool = False) -> np.ndarray:
        """[num_groups, grid]: log prior of a plus log-likelihood of each group's data at a.
        `cached`: one group at the current params; its censored terms come from `_censored_rows`."""
        mu_a = p.mu + a
        ll = -0.5 * (a / p.tau) ** 2 - math.log(p.tau) - _LOG_SQRT_2PI
        if len(d.y):
            ll = ll + _segment_sum(self._log_pdf((d.y[:, None] - mu_a[d.gi_e]) / p.sigma, p),
                                   d.gi_e, ll.shape[0], d.segments(d.gi_e))
        if len(d.c):
            if cached:
                terms = self._censored_rows(p, mu_a[0], d.c)
            elif d.c_first is None:
                terms = self._log_sf((d.c[:, None] - mu_a[d.gi_c]) / p.sigma, p)
            else:
                first = d.c_first
                terms = self._log_sf((d.c[first][:, None] - mu_a[d.gi_c[first]]) / p.sigma,
                                     p)[d.c_inverse]
            ll = ll + _segment_sum(terms, d.gi_c, ll.shape[0], d.segments(d.gi_c))
        return ll

    # ---- fitting --------------------------------------------------------------------------------
    def _neg_log_post(self, theta: np.ndarray, d: _Data) -> float:
        mu, ltau, lsig, leps = theta
        if not (-8.0 < ltau < 3.0 and -6.0 < lsig < 3.0 and -12.0 < leps < 0.0):
            return 1e300
        eps = _EPS_MAX / (1.0 + math.exp(-leps))
        p = LengthParams(float(mu), math.exp(ltau), math.exp(lsig), eps)
        a, log_da = self._grid(p, d)
        total = float(np.sum(_logsumexp(self._group_log_joint(p, a, d), 1) + log_da))
        pr = self.prior
        leps0 = -math.log(_EPS_MAX / pr.eps - 1.0)
        log_prior = (-0.5 * ((mu - pr.mu) / 3.0) ** 2
                     - 0.5 * (ltau - math.log(pr.tau)) ** 2
                     - 0.5 * (lsig - math.log(pr.sigma)) ** 2
                     - 0.5 * (leps - leps0) ** 2)
        return -(total + log_prior)

    @staticmethod
    def _theta(p: LengthParams) -> np.ndarray:
        return np.array([p.mu, math.log(p.tau), math.log(p.sigma),
                         -math.log(_EPS_MAX / min(p.eps, 0.99 * _EPS_MAX) - 1.0)])

    def _moments(self, d: _Data) -> LengthParams | None:
        """Crude start: every observation (censoring points too) taken as a length."""
        gi = np.concatenate([d.gi_e, d.gi_c])
        v = np.concatenate([d.y, d.c])
        if len(v) < 3:
            return None
        cnt = np.bincount(gi, minlength=d.num_groups).astype(np.float64)
        means = np.bincount(gi, weights=v, minlength=d.num_groups) / np.maximum(cnt, 1)
        within = float(np.mean((v - means[gi]) ** 2))
        between = float(np.var(means[cnt > 0]))
        return LengthParams(float(np.mean(v)), max(0.05, math.sqrt(between)),
                            max(0.05, math.sqrt(within)), self.prior.eps)

    def fit(self, groups: Sequence[GroupState]) -> LengthParams:
        """Refit (mu, tau, sigma, eps) to what the groups have shown so far (at most
        `max_fit_groups` of them, evenly spread: four population parameters need no more)."""
        if len(groups) > self.max_fit_groups:
            step = len(groups) / self.max_fit_groups
            groups = [groups[int(i * step)] for i in range(self.max_fit_groups)]
        d = self._data(groups)
        if d.num_groups == 0:
            return self.params
        d.dedupe_censored()
        f = lambda th: self._neg_log_post(th, d)  # noqa: E731
        # start from the best of: the last fit, the prior, and moments of the data (censoring
        # points taken as lengths); the last fit alone can sit in a local optimum once groups
        # unlike the early finishers arrive
        starts = [self._theta(self.params), self._theta(self.prior)]
        moments = self._moments(d)
        if moments is not None:
            starts.append(self._theta(moments))
        x0 = min(starts, key=f)
        x, _ = nelder_mead(f, x0)
        self.params = LengthParams(float(x[0]), math.exp(x[1]), math.exp(x[2]),
                                   _EPS_MAX / (1.0 + math.exp(-x[3])))
        self.fits += 1
        return self.params

    # ---- per group / per request ----------------------------------------------------------------
    def posterior(self, group: GroupState) -> tuple[np.ndarray, np.ndarray]:
        """The group's prompt effect a[g] given its responses: grid points [K] and normalized
        weights [K]."""
        p = self.params
        d = self._data([group])
        if d.num_groups == 0:
            d = _Data(*(np.zeros(0, t) for t in (np.int64, np.float64, np.int64, np.float64)),
                      np.zeros(1), np.zeros(1))
        a, _ = self._grid(p, d)
        ll = self._group_log_joint(p, a, d, cached=True)[0]
        w = np.exp(ll - ll.max())
        return a[0], w / w.sum()

    def _use_params(self, p: LengthParams) -> None:
        """Drop the caches when the params change (or they grow large)."""
        if p != self._sx_params or len(self._sx_cache) > 8192 or self._sf_count > 200_000:
            self._sx_params, self._sx_cache = p, {}
            self._sf_rows, self._sf_count = {}, 0

    def _censored_rows(self, p: LengthParams, mu_a: np.ndarray, c: np.ndarray) -> np.ndarray:
        """[len(c), K]: `_log_sf((c - mu_a) / sigma)`, row by row from a cache."""
        self._use_params(p)
        values = c.tolist()
        if not values:
            return np.zeros((0, len(mu_a)))
        cache = self._sf_rows.setdefault(mu_a.tobytes(), {})
        missing = [v for v in dict.fromkeys(values) if v not in cache]
        if missing:
            rows = self._log_sf((np.asarray(missing)[:, None] - mu_a[None, :]) / p.sigma, p)
            cache.update(zip(missing, rows, strict=True))
            self._sf_count += len(missing)
        return np.stack([cache[v] for v in values])

    def _survival_grid(self, p: LengthParams, mu_a: np.ndarray) -> np.ndarray:
        """[X, K]: P(log L > x) on the quantile grid at each prompt effect (cached per params)."""
        self._use_params(p)
        key = mu_a.tobytes()
        s_x = self._sx_cache.get(key)
        if s_x is None:
            s_x = np.exp(self._log_sf((self.x[:, None] - mu_a[None, :]) / p.sigma, p))
            self._sx_cache[key] = s_x
        return s_x

    def remaining_quantile(self, group: GroupState, requests: Sequence[RequestState], q: float,
                           posterior: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Per request: the q-quantile of its remaining tokens (>= 1, <= max_tokens - generated).
        `posterior`: the group's `posterior()` if already computed."""
        if not 0.0 < q < 1.0:
            raise ConfigError(f"quantile={q!r} must be in (0, 1)")
        p = self.params
        a, w = self.posterior(group) if posterior is None else posterior
        mu_a = p.mu + a  # [K]
        n = np.array([max(0, r.known_generated) for r in requests], dtype=np.float64)
        # survival of each request at its own progress, per grid point: [R, K]
        log_c = np.log(n + 0.5)
        s_n = np.exp(self._censored_rows(p, mu_a, log_c))
        wr = w[None, :] / np.maximum(s_n, 1e-300)  # P(L > x | L > n) weights: [R, K]
        s_x = self._survival_grid(p, mu_a)  # [X, K]
        surv = wr @ s_x.T  # [R, X]: P(L > e^x | L > n, data) (x below n is > 1: clipped below)
        target = 1.0 - q
        cap = self.max_tokens - n
        below = surv < target  # non-increasing rows: True from the quantile on
        j = np.where(below.any(axis=1), below.argmax(axis=1), len(self.x))
        jj = np.clip(j, 1, len(self.x) - 1)
        rows = np.arange(len(n))
        la = np.log(np.maximum(surv[rows, jj - 1], 1e-300))
        lb = np.log(np.maximum(surv[rows, jj], 1e-300))
        with np.errstate(divide="ignore", invalid="ignore"):
            f = np.where(la == lb, 0.0, (la - math.log(target)) / (la - lb))
        xq = self.x[jj - 1] + np.clip(f, 0.0, 1.0) * (self.x[jj] - self.x[jj - 1])
        xq = np.where(j == 0, self.x[0], xq)
        rem = np.minimum(cap, np.maximum(1.0, np.exp(xq) - n))
        return np.where(j >= len(self.x), cap, rem)
