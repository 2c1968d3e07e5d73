"""`oracle_lfs`: longest-first with true lengths (the paper's oracle upper bound).

Knows every request's true output length (from a previous run or a trace: `lengths`,
request_id -> tokens) and picks the request with the most remaining tokens first
(min(true length, max_tokens) - generated); ties first-come-first-served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from seer_jax.errors import ConfigError
from seer_jax.rollout.core.policies.base import GroupState, LazyHeap, Policy, RequestState


def true_lengths(policy: str, requests: Sequence[RequestState],
                 lengths: Mapping[str, int] | None) -> dict[str, int]:
    """request_id -> true output length (at most its max_tokens) from `lengths`;
    ConfigError naming `policy` when they are absent or miss a request."""
    if lengths is None:
        raise ConfigError(
            f"policy {policy!r} needs true lengths (request_id -> true output length, from "
            "a previous run or a trace); got None"
        )
    missing = [r.request_id for r in requests if r.request_id not in lengths]
    if missing:
        raise ConfigError(
            f"true lengths have no length for {len(missing)} request(s), e.g. {missing[:3]}; "
            "request ids are '<group_id>/<sample_index>'"
        )
    return {r.request_id: min(int(lengths[r.request_id]), r.max_tokens) for r in requests}


class OracleLFSPolicy(Policy):
    name = "oracle_lfs"
    divided = True
    kv_admission = True

    def __init__(self, lengths: Mapping[str, int] | None = None) -> None:
        super().__init__()
        self._heap = LazyHeap()
        self._given = lengths
        self._true: dict[str, int] = {}

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        super().bind(groups, options)
        self._true = true_lengths(self.name, self.requests, self._given)

    def estimate_remaining(self, req: RequestState) -> int | None:
        return max(1, self._true[req.request_id] - req.generated)

    def _push(self, req: RequestState) -> None:
        remaining = self._true[req.request_id] - req.generated
        self._heap.push((-remaining, req.enqueue_seq), req)

    def _pop(self) -> RequestState | None:
        return self._heap.peek(lambda r, t, _: self._live(r, t))


class GroupKeyedOraclePolicy(OracleLFSPolicy):
    """An oracle whose keys depend on what a request's group has revealed: its buffered
    requests are re-keyed whenever one of the group's chunks ends (only the newest key of each
    is live)."""

    def on_request_finished(self, req: RequestState) -> None:
        self._rekey(req.group)

    def on_chunk_end(self, req: RequestState) -> None:
        self._rekey(req.group)

    def _rekey(self, g: GroupState) -> None:
        for r in g.requests:
            if r.in_buffer:
                self._repush(r)
