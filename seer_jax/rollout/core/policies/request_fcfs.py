"""`request_fcfs`: divided rollout without context (the divided-rollout baseline).

Requests are chunked and placed on any instance by the controller's placement; the buffer is
first-come-first-served (a request whose chunk ended goes to the back of the line).
"""

from __future__ import annotations

from seer_jax.rollout.core.policies.base import LazyHeap, Policy, RequestState


class RequestFCFSPolicy(Policy):
    name = "request_fcfs"
    divided = True
    kv_admission = True

    def __init__(self) -> None:
        super().__init__()
        self._heap = LazyHeap()

    def _push(self, req: RequestState) -> None:
        self._heap.push((req.enqueue_seq,), req)

    def _pop(self) -> RequestState | None:
        return self._heap.peek(lambda r, t, _: self._live(r, t))
