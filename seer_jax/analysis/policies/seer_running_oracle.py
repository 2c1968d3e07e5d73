"""`seer_running_oracle`: seer with exact group maxima for started requests only (an analysis
policy, not a deployable one).

It is `seer` (probes first, fresh requests ranked by the posterior quantile of their remaining
length) except that a request which has already generated tokens is keyed by its group's *true*
longest length minus what it has generated, as `oracle_group_lfs` keys every request. So it
isolates one decision: how requests already under way are ranked against each other and against
fresh ones. Where it matches `oracle_group_lfs`, the whole value of group context lies in that
decision, and the gap between `seer` and it is what seer's estimate of running requests misses.
Built with true lengths like `oracle_lfs`; only the posterior estimator (used when seer's
options name none or first_finisher).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from seer_jax.analysis.policies.oracle_group_lfs import group_longest
from seer_jax.analysis.policies.oracle_lfs import true_lengths
from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies.base import GroupState
from seer_jax.rollout.core.policies.seer import SeerPolicy, posterior_options


class SeerRunningOraclePolicy(SeerPolicy):
    name = "seer_running_oracle"

    def __init__(self, lengths: Mapping[str, int] | None = None) -> None:
        super().__init__()
        self._given = lengths
        self._group_max: dict[str, int] = {}  # group_id -> true longest length (<= max_tokens)

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        true = true_lengths(self.name, [r for g in groups for r in g.requests], self._given)
        self._group_max = group_longest(groups, true)  # before seer's bind keys the groups
        options = posterior_options(options)
        super().bind(groups, options)
        if self.estimator != "posterior":
            raise ConfigError(
                "policy 'seer_running_oracle' replaces the posterior estimate of started "
                f"requests; estimator={self.estimator!r} is not supported (use 'posterior')")

    def _update_group(self, g: GroupState) -> None:
        super()._update_group(g)
        longest = self._group_max[g.group_id]
        for r in g.requests:
            if r.status != "done" and r.generated > 0:
                self._remaining[r.request_id] = float(max(1, longest - r.generated))
