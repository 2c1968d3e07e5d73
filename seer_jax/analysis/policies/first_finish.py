"""What a group's first finished response is worth: two analysis bounds (not deployable).

Both rank requests longest-remaining-first by a group length `M_g` minus what the request has
generated; a group with no finished response yet counts as `max_tokens` long (so among unknown
groups the request that has generated least goes first). They differ only in what `M_g` is once
the group's first response has finished:

- `oracle_first_finish`: the group's *true* longest length (from hindsight), revealed at that
  moment and not before. This is the ceiling for any rule that learns a group's length from its
  finished responses: exact information, at the earliest time the rollout offers it.
- `oracle_conditional_max`: the median true longest length among the rollout's groups whose
  shortest response is within a factor `CONDITIONAL_WIDTH` of this group's first finished length
  (at least `CONDITIONAL_MIN_GROUPS` of them, else `max_tokens`), raised to the most tokens a
  sibling has generated. It knows the rollout's own joint distribution of (shortest, longest)
  per group but not which group is which: the best *estimate* of the group maximum a rule could
  draw from the first finisher, with the distribution known in advance instead of learned.

On a real reasoning trace the first is within ~1% of `oracle_group_lfs` while the second falls
below `request_fcfs`: the first finisher identifies a group's length only when it is exact; any
estimate from it, even one fitted to the answer's own distribution, misplaces the few groups
whose long responses matter (results doc, "What the first finisher is worth").
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from seer_jax.analysis.policies.oracle_group_lfs import group_longest
from seer_jax.analysis.policies.oracle_lfs import GroupKeyedOraclePolicy
from seer_jax.rollout.core.policies.base import GroupState, RequestState

CONDITIONAL_WIDTH = 1.3  # oracle_conditional_max: "similar shortest" = within this factor
CONDITIONAL_MIN_GROUPS = 4  # ... and at least this many such groups, else max_tokens


class OracleFirstFinishPolicy(GroupKeyedOraclePolicy):
    name = "oracle_first_finish"

    def __init__(self, lengths: Mapping[str, int] | None = None) -> None:
        super().__init__(lengths)
        self._longest: dict[str, int] = {}  # group_id -> true longest length
        self._revealed: dict[str, int] = {}  # group_id -> M_g, once its first response finished

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        super().bind(groups, options)  # self._true: request_id -> true length
        self._longest = group_longest(groups, self._true)
        self._revealed = {}

    def group_length(self, g: GroupState) -> int:
        """M_g: the group's length as this policy knows it now."""
        return self._revealed.get(g.group_id, g.max_tokens)

    def reveal(self, g: GroupState, first_finished: int) -> int:
        """M_g once `g`'s first response finished with `first_finished` tokens."""
        return self._longest[g.group_id]

    def estimate_remaining(self, req: RequestState) -> int | None:
        return max(1, self.group_length(req.group) - req.generated)

    def on_request_finished(self, req: RequestState) -> None:
        g = req.group
        if g.group_id not in self._revealed:
            self._revealed[g.group_id] = self.reveal(g, req.generated)
        super().on_request_finished(req)

    def _push(self, req: RequestState) -> None:
        key = (-(self.group_length(req.group) - req.generated), req.enqueue_seq)
        self._heap.push(key, req)


class OracleConditionalMaxPolicy(OracleFirstFinishPolicy):
    name = "oracle_conditional_max"

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        super().bind(groups, options)
        pairs = sorted((min(self._true[r.request_id] for r in g.requests), self._longest[g.group_id])
                       for g in groups)
        self._shortest = [s for s, _ in pairs]
        self._longest_by_shortest = [m for _, m in pairs]

    def conditional_max(self, shortest: int, max_tokens: int) -> int:
        """Median longest length of the groups whose shortest is within CONDITIONAL_WIDTH of
        `shortest` (max_tokens when fewer than CONDITIONAL_MIN_GROUPS)."""
        lo = bisect.bisect_left(self._shortest, shortest / CONDITIONAL_WIDTH)
        hi = bisect.bisect_right(self._shortest, shortest * CONDITIONAL_WIDTH)
        near = self._longest_by_shortest[lo:hi]
        if len(near) < CONDITIONAL_MIN_GROUPS:
            return max_tokens
        return int(statistics.median(near))

    def group_length(self, g: GroupState) -> int:
        m = self._revealed.get(g.group_id)
        return g.max_tokens if m is None else max(m, g.max_generated)

    def reveal(self, g: GroupState, first_finished: int) -> int:
        return self.conditional_max(first_finished, g.max_tokens)
