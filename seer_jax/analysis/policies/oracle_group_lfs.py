"""`oracle_group_lfs`: longest-group-first with each group's true maximum length (an analysis
bound, not a deployable policy).

It knows what a perfect *group-context* estimator would know, and no more: every request of a
group is keyed by the group's true longest response (min(max true length, max_tokens)) minus
what the request has generated, the paper's L_g - generated rule with L_g exact from the start.
It does not know which sibling is the long one. Its throughput is the ceiling for any scheduler
that, like `seer`, orders requests by what their group reveals; the gap between it and
`oracle_lfs` is what only per-request knowledge buys. Built with true lengths like `oracle_lfs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from seer_jax.analysis.policies.oracle_lfs import OracleLFSPolicy
from seer_jax.rollout.core.policies.base import GroupState


def group_longest(groups: Sequence[GroupState], true: Mapping[str, int]) -> dict[str, int]:
    """group_id -> the longest of its requests' true lengths (`true`: request_id -> length)."""
    return {g.group_id: max(true[r.request_id] for r in g.requests) for g in groups}


class OracleGroupLFSPolicy(OracleLFSPolicy):
    name = "oracle_group_lfs"

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        # oracle_lfs's rule with every request's true length replaced by its group's longest
        super().bind(groups, options)
        longest = group_longest(groups, self._true)
        self._true = {r.request_id: longest[r.group_id] for r in self.requests}
