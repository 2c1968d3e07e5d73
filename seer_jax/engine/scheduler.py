"""Which requests run in an engine step, within the token budget and the KV pool.

Running requests first: decodes (one pending token), then chunks of prefill; then waiting
requests are admitted FCFS while the budget, the sequence slots and the pages allow. Group-mates
of a prompt being prefilled wait for its pages so they can share them. When pages run out the
most recently admitted running request is preempted (recompute: its KV is dropped; swap: kept on
the host) and goes back to the front of the queue.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

from seer_jax.engine.block_manager import OutOfPages
from seer_jax.engine.kv_cache import KVCacheManager
from seer_jax.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from seer_jax.engine.types import EngineConfig


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float]):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: collections.deque[Request] = collections.deque()
        self._running: dict[str, Request] = {}  # admission order
        self.num_preemptions = 0

    @property
    def running(self) -> list[Request]:
        return list(self._running.values())

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """req leaves (finished or aborted, running or waiting); its pages are freed."""
        if req.status is RequestStatus.RUNNING:
            del self._running[req.request_id]
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.to(RequestStatus.FINISHED)

    def preempt(self, req: Request) -> None:
        del self._running[req.request_id]
        self._unadmit(req)
        req.to(RequestStatus.WAITING)
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self, step: int) -> tuple[list[Request], list[tuple[Request, int]]]:
        """This step's decode requests and (request, tokens) prefill chunks."""
        c = self.config
        budget = c.max_num_batched_tokens
        decode: list[Request] = []
        prefill: list[tuple[Request, int]] = []
        scheduled: set[str] = set()
        # 1. running requests: decodes (one pending token) first, then prefill chunks, each in
        #    admission order (the order of `_running`)
        running = list(self._running.values())
        S = self.kv.page_size
        for seq in ([s for s in running if s.num_tokens - s.num_computed == 1]
                    + [s for s in running if s.num_tokens - s.num_computed != 1]):
            if seq.status is not RequestStatus.RUNNING:  # preempted making room for an earlier one
                continue
            if seq.num_new >= seq.max_tokens:  # last token still on the device (overlap)
                continue
            pending = seq.num_tokens - seq.num_computed
            if pending == 1:
                if len(decode) >= c.max_num_seqs or budget < 1:
                    continue
                n = 1
            else:
                if len(prefill) >= c.max_prefill_seqs or budget < 1:
                    continue
                n = min(pending, budget)
            if len(seq.pages) * S < seq.num_computed + n \
                    and not self._ensure_pages(seq, seq.num_computed + n, scheduled):
                continue
            scheduled.add(seq.request_id)
            budget -= n
            (decode.append(seq) if n == 1 and pending == 1 else prefill.append((seq, n)))
        # 2. admit waiting requests while the budget and pages allow (FCFS; group-mates of a
        #    prompt being prefilled wait for its pages so they can share them).
        prefilling = {s.prompt_key for s, _ in prefill if s.num_computed < len(s.prompt)}
        prefilling |= {s.prompt_key for s in self._running.values()
                       if s.num_computed < len(s.prompt)}
        deferred = []
        while self.waiting and budget > 0 and len(self._running) < c.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending_row >= 0:  # preempted with a token still on the device: next step
                break
            key = seq.prompt_key
            if (c.prefix_sharing and not seq.output and seq.swapped is None
                    and key in prefilling):
                deferred.append(self.waiting.popleft())
                continue
            if not self.kv.start(seq):
                break
            seq.admitted_at = step
            pending = seq.num_tokens - seq.num_computed
            is_decode = pending == 1
            if is_decode and len(decode) >= c.max_num_seqs:
                break
            if not is_decode and len(prefill) >= c.max_prefill_seqs:
                self._unadmit(seq)
                break
            n = 1 if is_decode else min(pending, budget)
            try:
                self.kv.grow(seq, seq.num_computed + n)
            except OutOfPages:
                self._unadmit(seq)
                break
            self.waiting.popleft()
            self._running[seq.request_id] = seq
            seq.to(RequestStatus.RUNNING)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = self.clock()
            scheduled.add(seq.request_id)
            budget -= n
            if is_decode:
                decode.append(seq)
            else:
                prefill.append((seq, n))
                if seq.num_computed < len(seq.prompt):
                    prefilling.add(key)
        self.waiting.extendleft(reversed(deferred))
        return decode, prefill

    def _ensure_pages(self, seq: Request, num_tokens: int, protected: set[str]) -> bool:
        """Grow seq's pages to hold num_tokens, preempting later-admitted running requests."""
        while True:
            try:
                self.kv.grow(seq, num_tokens)
                return True
            except OutOfPages:
                # a request whose last token is still on the device keeps its pages until
                # that token is committed (its KV may be returned with it)
                victims = [s for s in self._running.values()
                           if s.request_id not in protected and s is not seq and not s.done]
                if not victims:
                    return False
                self.preempt(max(victims, key=lambda s: s.admitted_at))

    def _unadmit(self, seq: Request) -> None:
        """Give back seq's pages (swapping its KV to the host first in swap mode)."""
        if self.config.preemption == "swap":
            self.kv.swap_out(seq)
        else:
            self.kv.free(seq)
