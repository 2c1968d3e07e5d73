"""The grouped draft service on Ray: shard actors, the engine actors' replicas, and the
controller's side of it (its record, fault injection, rebuilding a lost shard).

Who holds what:
- `draft_service.shards` shard actors (`DraftShard`, groups hashed over them by id) hold every
  group's append log: the group contexts in message form;
- each engine actor (a slice's leader) holds a `SyncedReplica`: full local contexts of the
  groups it has run, which it drafts from; it pushes its tokens after each step in one message
  per shard and pulls the other actors' tokens asynchronously (`seer_jax.drafting.replicated`);
- the controller's `RayDraftService` keeps a record of every request's committed tokens (the
  prompt and output of each chunk it submitted, plus the tokens each chunk returned).

Failure: a shard that dies is found by the replicas (their pull fails); they go on drafting from
their local contexts and report it in their step snapshot. The controller confirms it (a ping),
starts a new shard, seeds it from its record and sends it to every engine actor, whose replica
re-sends what it holds of that shard's groups (tokens of chunks still running) and pulls again.
Every token is applied once (appends carry their position), so no order of these matters.
A group whose requests have all finished is closed: the controller's record, the shards and the
replicas forget it (`close_group`), so none of them grows over a rollout. An
engine actor lost while holding replicas loses nothing the others need: its pushed tokens are
in the shards and its committed ones in the record. Weight sync touches none of this: drafts
depend on tokens, not weights.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from seer_jax.drafting.context import DraftConfig
from seer_jax.drafting.replicated import (
    DraftShard,
    ShardDownError,
    SyncConfig,
    SyncedReplica,
    shard_of,
)
from seer_jax.drafting.service import DraftAppend, GroupUpdate
from seer_jax.rollout.core.types import ChunkRequest, StepReport

BudgetFactory = Callable[[], Any]  # () -> SpeculationBudget, called on the engine actor


class RayShardLink:
    """A replica's `ShardLink` to a shard actor."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def push(self, appends: list[DraftAppend], epoch: int) -> None:
        # fire and forget: a dead shard shows in poll; one that was reset since drops it
        self.handle.append_batch.remote(appends, epoch)

    def pull(self, group_ids: list[str], since: dict[str, int], epoch: int) -> Any:
        return self.handle.sync.remote(group_ids, since, epoch)

    def poll(self, ref: Any, wait: bool, timeout_s: float) -> list[GroupUpdate] | None:
        import ray

        if not wait and not ray.wait([ref], timeout=0)[0]:
            return None
        try:
            return ray.get(ref, timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError,
                ray.exceptions.GetTimeoutError) as e:
            raise ShardDownError(f"draft-service shard: {type(e).__name__}") from None


@dataclasses.dataclass
class DraftSpec:
    """What an engine actor needs to draft: the shard actors, how replicas sync, how to build
    its speculation budget (None: the cost-model default), the draft settings and the epoch of
    the rollout the shards serve."""

    shards: list  # shard actor handles, index = shard
    sync: SyncConfig
    budget: BudgetFactory | None = None
    config: DraftConfig | None = None
    epoch: int = 0

    def make_speculator(self):
        """(Speculator, SyncedReplica) of an engine actor: the budget works per actor."""
        from seer_jax.drafting.budget import SpeculationBudget
        from seer_jax.engine.speculation import Speculator

        replica = SyncedReplica([RayShardLink(h) for h in self.shards], self.sync, self.config,
                                self.epoch)
        budget = self.budget() if self.budget is not None else SpeculationBudget.from_profile_json(None)
        return Speculator(replica, budget), replica


def start_shard(epoch: int = 0) -> Any:
    import ray

    return ray.remote(DraftShard).options(num_cpus=0, max_restarts=0).remote(epoch)


class RayDraftService:
    """The controller's side of the draft service (see module docstring). The proxies call
    `on_submit` and `on_step`; `instances` returns the live proxies (to send rebuilt shards to).
    fault_after_chunks >= 0: once that many chunks have ended, kill shard `fault_shard` (None:
    the shard holding the rollout's first group)."""

    def __init__(self, sync: SyncConfig, budget: BudgetFactory | None = None,
                 config: DraftConfig | None = None, fault_after_chunks: int = -1,
                 fault_shard: int | None = None, ping_timeout_s: float | None = None) -> None:
        """ping_timeout_s: how long a shard may take to answer the controller (None: the
        sync config's pull_timeout_s)."""
        self.sync = sync.validate()
        self.spec = DraftSpec([start_shard() for _ in range(sync.shards)], self.sync, budget, config)
        self.fault_after_chunks = fault_after_chunks
        self.fault_shard = fault_shard
        self.ping_timeout_s = sync.pull_timeout_s if ping_timeout_s is None else ping_timeout_s
        self.instances: Callable[[], list] = list
        self._clear()

    def _clear(self) -> None:
        self.record: dict[str, dict[str | None, list[int]]] = {}
        self._group_of: dict[str, str] = {}
        self.closed_groups = 0
        self.chunks = 0
        self.fault_fired = False
        self.killed_shard: int | None = None
        self.lost_shards = 0
        self.rebuilt_shards = 0
        self.rebuild_s = 0.0

    # ---- hooks of the proxies -------------------------------------------------------------------
    def on_submit(self, chunk: ChunkRequest) -> None:
        rec = self.record.setdefault(chunk.group_id, {})
        rec.setdefault(None, list(chunk.prompt_ids))
        rec[chunk.request_id] = list(chunk.output_ids)
        self._group_of[chunk.request_id] = chunk.group_id

    def on_step(self, rep: StepReport, snap: Any) -> None:
        for res in rep.finished:
            gid = self._group_of.get(res.request_id)
            if gid is not None:
                self.record[gid].setdefault(res.request_id, []).extend(res.new_token_ids)
        self.chunks += len(rep.finished)
        if (self.fault_after_chunks >= 0 and not self.fault_fired
                and self.chunks >= self.fault_after_chunks):
            first = next(iter(self.record), "")
            self.kill_shard(shard_of(first, self.sync.shards) if self.fault_shard is None
                            else self.fault_shard)
        status = getattr(snap, "draft", None) or {}
        for k in status.get("down", ()):
            self.check_shard(k)

    def close_group(self, group_id: str) -> None:
        """Every request of the group has finished: the record and the shard forget it (each
        instance's proxy calls this; the first call does it)."""
        reqs = self.record.pop(group_id, None)
        if reqs is None:
            return
        for rid in reqs:
            self._group_of.pop(rid, None)
        self.closed_groups += 1
        self.spec.shards[shard_of(group_id, self.sync.shards)].close_groups.remote(
            [group_id], self.spec.epoch)

    # ---- faults and rebuild ---------------------------------------------------------------------
    def kill_shard(self, k: int) -> None:
        """Fault injection: kill shard k's actor (the replicas find out by themselves)."""
        import ray

        self.fault_fired, self.killed_shard = True, k
        ray.kill(self.spec.shards[k], no_restart=True)

    def check_shard(self, k: int) -> bool:
        """Confirm shard k is alive; when it is not, rebuild it. True when it was rebuilt."""
        import ray

        handle = self.spec.shards[k]
        try:
            ray.get(handle.ping.remote(), timeout=self.ping_timeout_s)
            return False
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        self.lost_shards += 1
        self.rebuild(k)
        return True

    def rebuild(self, k: int) -> None:
        """A new shard k seeded from the controller's record, sent to every live engine actor
        (whose replicas add what they hold)."""
        import ray

        t0 = time.perf_counter()
        ray.kill(self.spec.shards[k], no_restart=True)
        handle = start_shard(self.spec.epoch)
        msgs = []
        for gid, reqs in self.record.items():
            if shard_of(gid, self.sync.shards) == k:
                msgs += [DraftAppend.make(gid, rid, toks, 0) for rid, toks in
                         sorted(reqs.items(), key=lambda kv: kv[0] is not None) if toks]
        ray.get(handle.append_batch.remote(msgs, self.spec.epoch), timeout=self.ping_timeout_s)
        self.spec.shards[k] = handle
        for inst in self.instances():
            if not inst.lost:
                inst.actor.set_draft_shard.remote(k, handle)
        self.rebuilt_shards += 1
        self.rebuild_s += time.perf_counter() - t0

    # ---- lifecycle ------------------------------------------------------------------------------
    def reset(self) -> list:
        """Empty shards and record for the next rollout, a new epoch: the shards drop what the
        last rollout's replicas still push, and every live engine actor's replica is cleared
        into the new epoch (those calls land before the actor's next reset or step; their refs
        are returned). Lost shards are replaced."""
        import ray

        self.spec.epoch += 1
        for k, h in enumerate(self.spec.shards):
            try:
                ray.get(h.reset.remote(self.spec.epoch), timeout=self.ping_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.spec.shards[k] = start_shard(self.spec.epoch)
                for inst in self.instances():  # lands before the actor's reset
                    if not inst.lost:
                        inst.actor.set_draft_shard.remote(k, self.spec.shards[k])
        self._clear()
        return [a.clear_drafts.remote(self.spec.epoch)
                for inst in self.instances() if not inst.lost for a in inst.actors]

    def new_rollout(self) -> None:
        """Between rollouts on the same engines (a trainer's): every replica and shard forgets
        the last rollout's groups."""
        import ray

        ray.get(self.reset())

    def stats(self, snapshots: list | None = None) -> dict:
        """The service's counters and the replicas' (summed over the given actor snapshots)."""
        import ray

        out: dict[str, Any] = {"shards": self.sync.shards,
                               "max_stale_steps": self.sync.max_stale_steps,
                               "sync_every_steps": self.sync.sync_every_steps,
                               "lost_shards": self.lost_shards,
                               "rebuilt_shards": self.rebuilt_shards,
                               "rebuild_s": self.rebuild_s, "epoch": self.spec.epoch,
                               "closed_groups": self.closed_groups}
        if self.fault_fired and self.lost_shards == 0:  # killed, never reported by a replica
            try:
                ray.get(self.spec.shards[self.killed_shard].ping.remote(),
                        timeout=self.ping_timeout_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                out["lost_shards"] = 1
        replicas: dict[str, float] = {}
        for snap in snapshots or []:
            status = getattr(snap, "draft", None) or {}
            for key, v in status.items():
                if isinstance(v, (int, float)):
                    replicas[key] = replicas.get(key, 0) + v
        out["replicas"] = replicas
        return out

    def shutdown(self) -> None:
        import ray

        for h in self.spec.shards:
            ray.kill(h, no_restart=True)
