"""The host-side rollout controller: divided rollout, KV pool, placement, context-aware policies.

What it does: a batch of groups (one prompt, G responses each) becomes G
requests per group; a request runs as a sequence of *chunks* of at most `chunk_size` new tokens
(`max_new_tokens = min(chunk_size, original_max_tokens - generated)`). Between chunks the request
waits in the *request buffer*, ordered by the policy (`seer_jax.rollout.core.policies`), and its KV
lives in the global KV pool (`seer_jax.rollout.backends.kv_pool`); placement
(`seer_jax.rollout.core.placement`) picks the instance for each chunk. Each response is returned once
with its tokens, logprobs, finish reason and timing.

Plugging instances in
---------------------
An instance is anything implementing `seer_jax.rollout.core.instance.Instance` (`now`, `set_now`,
`submit`, `has_work`, `step`, `load`, `resident_tokens`, `abort`, attribute `instance_id`).
Contract the controller relies on:
- ids are 0..N-1 in list order; `load()` reports the KV page capacity (`total_kv_pages`,
  `page_size`), read once at start;
- `submit(chunk)` queues a `ChunkRequest`; the instance continues after `chunk.output_ids`,
  producing at most `chunk.max_new_tokens` tokens. If `chunk.kv_handle` is set and the instance
  does not hold that request's KV resident, it imports it with `pool.get(handle)` (None: evicted,
  re-prefill prompt + output_ids: results must not change);
- `step()` runs one engine iteration, advances the instance clock, and returns the chunks that
  ended in it (`StepReport.finished`). A chunk ends with `finish_reason` "eos"/"stop"/"length"
  when the request is done, or None when its chunk budget ran out; then the instance has put the
  request's KV into the pool (`pool.put(request_id, blob, nbytes)`, handle in
  `ChunkResult.kv_handle`) and may keep it resident as evictable cache (`resident_tokens`);
- a lost instance raises `InstanceLostError` from `step()` or `submit()` (or the caller calls
  `Controller.on_instance_lost`); its chunks are re-dispatched elsewhere from the last pool copy
  (or by re-prefill), so every request is still returned exactly once;
- time: the controller never reads a clock. Drivers (`seer_jax.rollout.core.driver`) step instances
  and hand it the time: `EmulatedClusterDriver` (each instance on its own virtual clock advanced
  by its step durations: measured, or a cost model) and `WallClockDriver` (real time).
Under KV-budget admission the controller submits a chunk only when the pages already reserved
on that instance plus the chunk's worst case (ceil((context + max_new_tokens) / page_size)) fit
its capacity, so an instance that admits by free pages never preempts.

Entry points: `rollout(...)` (build + drive + report in one call) or, for custom drivers,
`Controller` (`start`, `dispatch`, `on_chunk_result`, `on_instance_lost`, `done`, `results`).
The requests' own bookkeeping (built from the groups, ended chunks accounted, restored tokens,
the responses) is `seer_jax.rollout.core.requests`; this module decides where chunks run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from seer_jax.errors import ConfigError, InputError, SeerError
from seer_jax.rollout.core.controller_config import ControllerConfig, request_seed
from seer_jax.rollout.core.instance import Instance, InstanceLostError, KVPool
from seer_jax.rollout.core.journal import RequestRecord
from seer_jax.rollout.core.placement import InstanceSlot, choose_instance, least_loaded_order
from seer_jax.rollout.core.policies import POLICIES, Policy, RequestState, make_policy
from seer_jax.rollout.core.requests import (
    account_chunk,
    build_groups,
    response_result,
    restore_tokens,
)
from seer_jax.rollout.core.results import ControllerStats, JournalSink, ProgressFn, ResponseResult
from seer_jax.rollout.core.types import (
    ChunkRequest,
    ChunkResult,
    FinishReason,
    InstanceLoad,
    SamplingParams,
)

__all__ = ["Controller", "ControllerConfig", "ControllerStats", "JournalSink", "ProgressFn",
           "ResponseResult", "request_seed"]


class Controller:
    """Turns groups into chunks, places them on instances and collects the responses.

    Drive it with `start(now)`, then repeatedly: step instances, `on_chunk_result(result, now)`
    for every ended chunk, `dispatch(now)`; until `done`. Drivers in `seer_jax.rollout.core.driver`.
    """

    def __init__(
        self,
        groups: Sequence[Sequence[int]],
        *,
        group_size: int,
        max_tokens: int,
        instances: Sequence[Instance],
        sampling: SamplingParams | None = None,
        policy: str | Policy = "seer",
        config: ControllerConfig | Mapping[str, Any] | None = None,
        pool: KVPool | None = None,
        group_ids: Sequence[str] | None = None,
        progress: ProgressFn | None = None,
        policy_options: Mapping[str, Any] | None = None,
        journal: JournalSink | None = None,
        target_groups: int | None = None,
        weight_version: int = 0,
    ):
        self.config = (
            config.validate()
            if isinstance(config, ControllerConfig)
            else ControllerConfig.from_mapping(config)
        )
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        if not isinstance(self.policy, Policy):
            raise ConfigError(f"policy={policy!r} is invalid; allowed: {sorted(POLICIES)}")
        if not isinstance(group_size, int) or group_size < 1:
            raise ConfigError(f"group_size={group_size!r} is invalid; allowed: an integer >= 1")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens={max_tokens!r} is invalid; allowed: an integer >= 1")
        if not instances:
            raise ConfigError("instances=[] is invalid; allowed: at least one Instance")
        if len(groups) == 0:
            raise InputError("no prompts: groups is empty")
        sampling = sampling or SamplingParams()
        sampling.validate()
        ids = [inst.instance_id for inst in instances]
        if ids != list(range(len(instances))):
            raise ConfigError(f"instance ids must be 0..{len(instances) - 1} in order, got {ids}")
        if target_groups is not None and (
                isinstance(target_groups, bool) or not isinstance(target_groups, int)
                or not 1 <= target_groups <= len(groups)):
            raise ConfigError(f"target_groups={target_groups!r} is invalid; allowed: None (every "
                              f"group) or an integer in 1..{len(groups)} (the number of groups)")
        if target_groups is not None and not self.policy.divided:
            raise ConfigError(f"target_groups={target_groups!r} with policy {self.policy.name!r} is "
                              "invalid: it runs each request whole as one chunk, so nothing is "
                              "left to carry over; allowed: a divided policy (e.g. seer)")
        if group_ids is None:
            group_ids = [f"g{i}" for i in range(len(groups))]
        if len(group_ids) != len(groups) or len(set(group_ids)) != len(group_ids):
            raise InputError("group_ids must be unique and one per group")

        self.instances = list(instances)
        self.pool = pool
        self.max_tokens = max_tokens
        self.progress = progress
        self.journal = journal
        self.target_groups = target_groups
        self.weight_version = int(weight_version)
        self.restored = 0  # requests restored finished (`restore`): returned, not regenerated
        self.complete_groups = 0
        self.stats = ControllerStats()
        self.slots: list[InstanceSlot] = []
        # request_id -> instance where room is being kept for it (it fit nowhere when popped)
        self._room_target: dict[str, int] = {}
        for inst in self.instances:
            ld = inst.load()
            self.slots.append(
                InstanceSlot(
                    instance_id=inst.instance_id,
                    total_pages=ld.total_kv_pages,
                    page_size=ld.page_size,
                    max_in_flight=self._in_flight_cap(ld),
                )
            )
        capacity = max(s.total_pages * s.page_size for s in self.slots)

        self.groups, self.requests = build_groups(
            groups, group_ids, group_size=group_size, max_tokens=max_tokens, sampling=sampling,
            per_request_seeds=self.config.per_request_seeds, capacity=capacity)
        self.policy.bind(self.groups, self.policy.check_options(policy_options or {}))
        self.num_done = 0
        self.output_tokens = 0
        self.started = False
        # instance clock value at driver time 0 (None: instance clocks are not the driver's, so
        # instance-side timestamps are ignored); set by the driver
        self.instance_clock_origin: float | None = 0.0

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Every request finished; with `target_groups`: that many groups are complete and no
        chunk is running (the others wait in the buffer, to be carried over)."""
        if self.num_done == len(self.requests):
            return True
        return self.target_reached and not any(s.in_flight for s in self.slots if s.alive)

    @property
    def target_reached(self) -> bool:
        return self.target_groups is not None and self.complete_groups >= self.target_groups

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def start(self, now: float = 0.0) -> None:
        """Put every request in the buffer (group order) and pin groups for non-divided policies."""
        if self.started:
            raise RuntimeError("controller already started")
        self.started = True
        n = len(self.slots)
        for g in self.groups:
            for r in g.requests:
                if r.status == "done":  # restored finished
                    continue
                r.submitted_at = now
                if not self.policy.divided:
                    r.pinned_instance = g.index % n
                self.policy.push(r)

    def _in_flight_cap(self, ld: InstanceLoad) -> int | None:
        cap = self.config.max_in_flight_per_instance
        if cap == 0:
            return ld.max_running or None
        return None if cap < 0 else cap

    def dispatch(self, now: float) -> int:
        """Submit chunks while instances have room; returns how many were submitted."""
        if not self.started:
            self.start(now)
        self.stats.dispatch_rounds += 1
        if self.target_reached:  # partial rollout: the in-flight chunks end, nothing new starts
            return 0
        if not any(s.alive for s in self.slots):
            if not self.done:
                raise SeerError(
                    f"all {len(self.slots)} instances are lost; "
                    f"{self.num_requests - self.num_done} requests unfinished"
                )
            return 0
        if not self.policy.divided:
            return self._dispatch_pinned(now)
        submitted = 0
        held: list[RequestState] = []
        kv_adm = self.policy.kv_admission
        resident = [inst.resident_tokens for inst in self.instances]
        while len(self.policy) > 0:
            if not any(s.fits(1, kv_adm) for s in self.slots if s.alive):
                break
            req = self.policy.pop()
            # the chunk's worst-case context, once per request (the same on every slot)
            tokens = len(req.prompt_ids) + req.generated + self._chunk_budget(req)
            rid, gid = req.request_id, req.group_id
            slot = choose_instance(
                self.slots,
                lambda s, tokens=tokens: -(-tokens // s.page_size),
                lambda s, rid=rid, gid=gid: resident[s.instance_id](rid, gid),
                self.config.balance_threshold,
                kv_adm,
            )
            if slot is None or not self._submit(slot, req, now):
                held.append(req)
                alive = [s for s in self.slots if s.alive]
                if not alive:
                    break
                if kv_adm:
                    # keep room growing for it: block its pages on one instance, the same one
                    # every round until it runs (chosen where the most budget was free); a
                    # target that moved with the free budget would let smaller requests take
                    # the room freed on the last one, round after round
                    tid = self._room_target.get(req.request_id)
                    if tid is None or not self.slots[tid].alive:
                        target = max(alive, key=lambda s: (s.free_pages, -s.instance_id))
                        self._room_target[req.request_id] = target.instance_id
                    else:
                        target = self.slots[tid]
                    target.blocked_pages += self._chunk_pages(req, target)
                if len(held) >= self.config.dispatch_lookahead:
                    break
                continue
            self._room_target.pop(req.request_id, None)
            submitted += 1
        for s in self.slots:
            s.blocked_pages = 0
        for r in held:
            self.policy.push(r, requeue=True)
        return submitted

    def on_chunk_result(self, res: ChunkResult, now: float) -> None:
        """Record a chunk that ended on an instance (delivered by the driver at time `now`)."""
        req = self.requests.get(res.request_id)
        if req is None:
            raise SeerError(f"instance {res.instance_id} returned unknown request {res.request_id!r}")
        if req.status != "running" or req.instance_id != res.instance_id:
            raise SeerError(
                f"instance {res.instance_id} returned a chunk of {res.request_id!r}, which is "
                f"{req.status} on instance {req.instance_id}"
            )
        n = len(res.new_token_ids)
        if n > req.chunk_max_new:
            raise SeerError(
                f"instance {res.instance_id} returned {n} tokens for {res.request_id!r}, "
                f"chunk budget was {req.chunk_max_new}"
            )
        if res.new_logprobs and len(res.new_logprobs) != n:
            raise SeerError(
                f"{res.request_id!r}: {len(res.new_logprobs)} logprobs for {n} tokens"
            )
        if self.policy.wants_progress():
            self._collect_progress()
        slot = self.slots[res.instance_id]
        slot.in_flight -= 1
        slot.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0
        account_chunk(req, self.stats, res, self.weight_version)
        self.output_tokens += n
        if req.first_token_at is None and n > 0:
            first = res.first_token_at
            if first is None or self.instance_clock_origin is None:
                req.first_token_at = now
            else:
                req.first_token_at = min(now, first - self.instance_clock_origin)
        req.last_instance = res.instance_id
        req.instance_id = None
        req.in_flight_tokens = 0
        reason = res.finish_reason
        if reason is None and req.generated >= req.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(req, reason, now)
        else:
            if self.journal is not None:
                self.journal.chunk_end(req.request_id, req.generated, list(map(int, res.new_token_ids)),
                                       list(map(float, res.new_logprobs)), self.weight_version,
                                       res.new_routed_experts)
            req.kv_handle = res.kv_handle
            req.status = "buffer"
            req.group.record_progress(req)
            self.policy.on_chunk_end(req)
            self.policy.push(req)

    def on_instance_lost(self, instance_id: int, now: float) -> None:
        """Mark an instance lost and put its in-flight requests back in the buffer."""
        slot = self.slots[instance_id]
        if not slot.alive:
            return
        slot.alive = False
        self.stats.lost_instances.append(instance_id)
        lost = [
            r for r in self.requests.values() if r.status == "running" and r.instance_id == instance_id
        ]
        for r in lost:
            r.status = "buffer"
            r.instance_id = None
            r.in_flight_tokens = 0
            r.reserved_pages = 0
            self.stats.redispatched_chunks += 1
        slot.in_flight = 0
        slot.reserved_pages = 0
        if not self.policy.divided:
            alive = least_loaded_order(self.slots)
            if alive:
                moved = sorted(
                    {r.group.index for r in self.requests.values() if r.pinned_instance == instance_id}
                )
                for k, gi in enumerate(moved):
                    for r in self.groups[gi].requests:
                        r.pinned_instance = alive[k % len(alive)].instance_id
        for r in lost:
            self.policy.push(r)

    def add_instance(self, inst: Instance) -> int:
        """Register an instance that joined during the rollout (e.g. a replacement for a lost
        one); later chunks may be placed on it. Its id must be the next one (len(instances))."""
        if inst.instance_id != len(self.instances):
            raise SeerError(f"a joining instance must have id {len(self.instances)}, "
                            f"got {inst.instance_id}")
        ld = inst.load()
        self.instances.append(inst)
        self.slots.append(InstanceSlot(instance_id=inst.instance_id, total_pages=ld.total_kv_pages,
                                       page_size=ld.page_size, max_in_flight=self._in_flight_cap(ld)))
        self.stats.replacement_instances.append(inst.instance_id)
        return inst.instance_id

    def restore(self, rec: RequestRecord, sampling: SamplingParams | None = None,
                kv_handle: str | None = None) -> None:
        """Give a request the tokens it already has, before `start`: from a journal being resumed,
        or carried over from an earlier rollout. A finished record finishes it (its response is
        returned as recorded, never regenerated); an unfinished one continues after its tokens,
        from `kv_handle`'s KV in the pool when given (else by re-prefill). `sampling`: the
        request's own parameters (its seed), when they are not the ones this controller derives."""
        if self.started:
            raise SeerError(f"restore({rec.request_id!r}) after the rollout started")
        req = self.requests.get(rec.request_id)
        if req is None:
            raise InputError(f"restore: no request {rec.request_id!r} in this rollout")
        restore_tokens(req, rec, sampling)
        if rec.finish_reason is None:
            req.kv_handle = kv_handle
            req.group.record_progress(req)
            self.policy.on_chunk_end(req)
            return
        req.status = "done"
        req.finish_reason = rec.finish_reason
        req.finished_at = rec.finished_at
        self._record_finished(req)
        self.restored += 1

    def results(self, detokenize: Callable[[list[int]], str] | None = None) -> list[ResponseResult]:
        """Every response, in group order then sample order (call when `done`); with
        `target_groups`, those of the complete groups only."""
        if not self.done:
            raise SeerError(f"rollout not finished: {self.num_requests - self.num_done} requests left")
        return [response_result(r, detokenize) for g in self.groups
                if g.num_finished == len(g.requests) for r in g.requests]

    # ---- internals -----------------------------------------------------------------------------
    def _collect_progress(self) -> None:
        """Note how far every running chunk has got (`Instance.running_progress`, where implemented)."""
        for slot, inst in zip(self.slots, self.instances, strict=True):
            fn = getattr(inst, "running_progress", None)
            if not slot.alive or fn is None:
                continue
            for rid, n in fn().items():
                req = self.requests.get(rid)
                if req is not None and req.status == "running" and req.instance_id == slot.instance_id:
                    req.in_flight_tokens = max(req.in_flight_tokens, int(n) - req.generated)

    def _chunk_budget(self, req: RequestState) -> int:
        if not self.policy.divided:
            return req.remaining
        budget = min(self.config.chunk_size, req.remaining)
        if self.config.estimate_chunks:
            est = self.policy.estimate_remaining(req)
            if est is not None:
                sized = max(self.config.min_chunk_size, math.ceil(self.config.estimate_margin * est))
                budget = min(budget, sized)
        return budget

    def _chunk_pages(self, req: RequestState, slot: InstanceSlot) -> int:
        return slot.pages_for(len(req.prompt_ids) + req.generated + self._chunk_budget(req))

    def _submit(self, slot: InstanceSlot, req: RequestState, now: float) -> bool:
        budget = self._chunk_budget(req)
        chunk = ChunkRequest(
            request_id=req.request_id,
            group_id=req.group_id,
            prompt_ids=req.prompt_ids,
            output_ids=tuple(req.output_ids),
            max_new_tokens=budget,
            original_max_tokens=req.max_tokens,
            sampling=req.sampling,
            kv_handle=req.kv_handle,
            priority=self.policy.priority(req),
        )
        inst = self.instances[slot.instance_id]
        try:
            if not inst.has_work() and inst.now() < now:
                inst.set_now(now)
            inst.submit(chunk)
        except InstanceLostError:
            self.on_instance_lost(slot.instance_id, now)
            return False
        pages = self._chunk_pages(req, slot) if self.policy.kv_admission else 0
        slot.in_flight += 1
        slot.reserved_pages += pages
        req.reserved_pages = pages
        req.chunk_max_new = budget
        req.status = "running"
        req.instance_id = slot.instance_id
        if req.first_scheduled_at is None:
            req.first_scheduled_at = now
        if req.last_instance is not None and req.last_instance != slot.instance_id:
            req.migrations += 1
            self.stats.migrations += 1
        req.instances_visited.append(slot.instance_id)
        return True

    def _dispatch_pinned(self, now: float) -> int:
        submitted = 0
        held = []
        while len(self.policy) > 0:
            req = self.policy.pop()
            slot = self.slots[req.pinned_instance]
            if not slot.alive or not self._submit(slot, req, now):
                held.append(req)
                continue
            submitted += 1
        for r in held:
            self.policy.push(r, requeue=True)
        return submitted

    def _record_finished(self, req: RequestState) -> None:
        g = req.group
        g.record_finished(req)
        if g.num_finished == len(g.requests):
            self.complete_groups += 1
            for inst in self.instances:  # its draft contexts and prompt records can go
                close = getattr(inst, "close_group", None)
                if close is not None:
                    close(g.group_id)
        self.policy.on_request_finished(req)
        self.num_done += 1

    def _finish(self, req: RequestState, reason: FinishReason, now: float) -> None:
        req.status = "done"
        req.finish_reason = reason
        req.finished_at = now
        req.kv_handle = None
        if self.pool is not None:
            self.pool.delete(req.request_id)
        self._record_finished(req)
        if self.journal is not None:
            self.journal.finished(RequestRecord(
                req.request_id, list(req.output_ids), list(req.logprobs), req.weight_versions,
                reason, now, req.num_chunks,
                req.routed_experts if req.sampling.return_routed_experts else None))
        if self.progress is not None:
            self.progress(self.num_done, self.num_requests, self.output_tokens, now)
