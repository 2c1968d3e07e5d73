"""`seer`: context-aware scheduling (DESIGN.md §2.2, Seer paper §4.3).

- Every group has one *probe* request (its sample 0). While the group has no finished request,
  its probe sits in a high-priority queue ordered *shortest generated so far first* (SFS), so
  every group quickly produces a length signal. Probe chunks carry ChunkRequest.priority 1.
- Otherwise requests are picked by *largest group length estimate first* (approximate
  longest-job-first): L_g = max output length among the group's finished requests, the original
  max_tokens while none has finished (unknown groups are assumed long). Our refinement: once
  known, L_g is raised to the most tokens an unfinished sibling has already generated (the group
  is at least that long). The controller updates the group whenever a chunk ends and the policy
  re-keys the group's buffered siblings.
  Ties (e.g. all unknown groups at max_tokens): the group whose requests have generated most so
  far (a probe that ran a whole chunk without finishing hints at a long group), then lower
  sample index (so unknown groups advance one sibling each in turn), then group order.
- Starvation guard: a request that has stayed in the buffer while more than `starvation_pops`
  other requests were popped is served next, oldest first (default: the number of requests in
  the batch; 0 disables the guard). This bounds the damage of a bad (too small) estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seer_jax.rollout.policies.base import GroupState, LazyHeap, Policy, RequestState


class SeerPolicy(Policy):
    name = "seer"
    divided = True
    kv_admission = True

    def __init__(self) -> None:
        super().__init__()
        self._probes = LazyHeap()
        self._lfs = LazyHeap()
        self._fifo = LazyHeap()
        self._pops_at_enqueue: dict[str, int] = {}
        self.starvation_pops = 0
        self.starved_pops = 0  # how often the guard fired

    def bind(self, groups: Sequence[GroupState], options: dict[str, Any]) -> None:
        super().bind(groups, options)
        limit = options.get("starvation_pops")
        self.starvation_pops = len(self.requests) if limit is None else int(limit)
        for g in groups:
            for r in g.requests:
                r.is_probe = r.sample_index == 0

    def probe_active(self, req: RequestState) -> bool:
        return req.is_probe and req.group.finished_max_len is None

    def estimate_remaining(self, req: RequestState) -> int | None:
        g = req.group
        if g.finished_max_len is None or g.length_estimate <= req.generated:
            return None
        return g.length_estimate - req.generated

    def priority(self, req: RequestState) -> int:
        return 1 if self.probe_active(req) else 0

    def push(self, req: RequestState, requeue: bool = False) -> None:
        if not requeue:
            self._pops_at_enqueue[req.request_id] = self.pops
        super().push(req, requeue)

    def _push(self, req: RequestState) -> None:
        if self.starvation_pops > 0:
            self._fifo.push((req.enqueue_seq,), req)
        if self.probe_active(req):
            self._probes.push((req.generated, req.enqueue_seq), req)
        else:
            self._push_lfs(req)

    def _push_lfs(self, req: RequestState) -> None:
        g = req.group
        key = (-g.length_estimate, -g.max_generated, req.sample_index, g.index)
        self._lfs.push(key, req, extra=g.version)

    def _pop(self) -> RequestState | None:
        if self.starvation_pops > 0:
            oldest = self._fifo.peek(lambda r, t, _: self._live(r, t))
            if (
                oldest is not None
                and self.pops - self._pops_at_enqueue[oldest.request_id] > self.starvation_pops
            ):
                self.starved_pops += 1
                return oldest
        probe = self._probes.peek(lambda r, t, _: self._live(r, t) and self.probe_active(r))
        if probe is not None:
            return probe
        return self._lfs.peek(lambda r, t, v: self._live(r, t) and v == r.group.version)

    def on_request_finished(self, req: RequestState) -> None:
        self._rekey(req.group)

    def on_chunk_end(self, req: RequestState) -> None:
        self._rekey(req.group)

    def _rekey(self, g: GroupState) -> None:
        # the controller updated the group (estimate, max generated, version): re-key the
        # buffered siblings (a probe whose group now has an estimate leaves the probe class)
        for r in g.requests:
            if r.in_buffer and not self.probe_active(r):
                self._push_lfs(r)
