"""`seer_prompt_oracle`: seer with a perfect length model (an analysis policy, simulator only).

It is `seer` (probes first, then requests ranked by the `quantile` of their remaining length)
except that the estimate comes from the distribution each prompt's lengths were *generated* from
(a synthetic workload's log L ~ N(log median of the group, log sd within groups^2), capped at
max_tokens), not from a model fitted online. A request that has generated n tokens is keyed by the
q-quantile of L - n given L > n under its group's true distribution.

That is everything any group-context estimator could learn about a request's length: given the
prompt's distribution, the siblings' lengths say nothing more about this sample. So it tells
whether seer's rule falls short of `oracle_lfs` for want of information about the prompts (it
would then reach it here) or for want of information about the samples, which no group context
holds. (`oracle_group_lfs` knows more: each group's realized longest response, which is the long
sample's own length.) The rule is not monotone in what it knows: a more hedged estimate can
schedule better than the true one (on Moonlight at ICC 0.6 seer's online fit does). Needs
`length_distributions` (group_id -> (log median, log sd)), which the simulator passes for
synthetic workloads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import Any

from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies.base import GroupState
from seer_jax.rollout.core.policies.seer import SeerPolicy, posterior_options

_NORMAL = NormalDist()


def lognormal_remaining_quantile(log_median: float, log_sd: float, generated: int, q: float,
                                 max_tokens: int) -> float:
    """The q-quantile of L - generated given L > generated, for log L ~ N(log_median, log_sd^2)
    capped at max_tokens; within [1, max_tokens - generated]."""
    cap = max_tokens - generated
    if log_sd <= 0:
        return float(min(cap, max(1.0, math.exp(log_median) - generated)))
    # P(L > x | L > n) = 1 - q  <=>  S(x) = (1 - q) S(n), S(y) = Phi(-(log y - m) / s)
    s_n = _NORMAL.cdf(-(math.log(generated + 0.5) - log_median) / log_sd) if generated > 0 else 1.0
    p = (1.0 - q) * s_n
    if p <= 1e-300:
        return float(cap)
    x = math.exp(log_median - log_sd * _NORMAL.inv_cdf(p))
    return float(min(cap, max(1.0, x - generated)))


class SeerPromptOraclePolicy(SeerPolicy):
    name = "seer_prompt_oracle"

    def __init__(self, length_distributions: Mapping[str, tuple[float, float]] | None = None) -> None:
        super().__init__()
        self._given = length_distributions
        self._dist: dict[str, tuple[float, float]] = {}

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        dists = self._given
        if dists is None:
            raise ConfigError(
                f"policy {self.name!r} needs length_distributions (group_id -> (log median, log "
                "sd) of its lengths), which only a synthetic simulator workload has; got None")
        missing = [g.group_id for g in groups if g.group_id not in dists]
        if missing:
            raise ConfigError(f"length_distributions has no entry for {len(missing)} group(s), "
                              f"e.g. {missing[:3]}")
        self._dist = {g.group_id: (float(dists[g.group_id][0]), float(dists[g.group_id][1]))
                      for g in groups}
        options = posterior_options(options)
        super().bind(groups, options)  # keys every group through _update_group
        if self.estimator != "posterior":
            raise ConfigError(
                f"policy {self.name!r} replaces the posterior estimate; "
                f"estimator={self.estimator!r} is not supported (use 'posterior')")

    def _update_group(self, g: GroupState) -> None:
        m, s = self._dist[g.group_id]
        for r in g.requests:
            if r.status != "done":
                self._remaining[r.request_id] = lognormal_remaining_quantile(
                    m, s, max(0, r.known_generated), self.quantile, r.max_tokens)
