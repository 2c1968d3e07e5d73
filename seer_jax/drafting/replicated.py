"""A draft service split into shards in other processes, and the replica an engine drafts from.

`DraftShard` holds the append log of the groups hashed to it (`shard_of`): every message carries
its position in its request (`DraftAppend.start`), so appending a message that is already there
in part (a re-sent message, a replica re-seeding a rebuilt shard) keeps each token once.
`sync(group_ids, since)` returns what a replica has not seen (the `DraftService.sync` message).

`SyncedReplica` is what an engine's `Speculator` uses as its service when the contexts live
elsewhere. It keeps a full local `ArenaDraftContext` of every group it has run, drafts from it
without any remote call, and talks to the shards through `ShardLink`s (a transport: Ray actors
in `rollout.backends.ray_draft_service`, plain objects in tests):

- its own tokens go into the local contexts at once and, at the end of each step, to the shards
  in one batched message per shard (`after_step`);
- every `sync_every_steps` steps it asks each shard for the other instances' appends to its
  active groups (an asynchronous pull, issued after a step so it overlaps the next one);
- before a step it applies the pulls that have arrived; one issued `max_stale_steps` or more
  steps ago is waited for. One pull per shard is in flight, so the bound on how many steps a
  replica's drafts lack another instance's token is `SyncConfig.max_lag_steps`. Verification is
  lossless: staleness costs acceptance, never tokens.

A group is closed when its last request has finished (`close_groups`: the controller tells the
shards and every replica); a closed group's late messages are dropped, so shard and replica
memory return to what they held before the rollout. A message whose start lies beyond what a
shard holds of its request (a gap: tokens lost with a shard) is held until the missing tokens
arrive (a replica re-seeding a rebuilt shard sends them) and never appended out of place; a
replica that pulls such a gap resyncs the group (pulls its log again from version 0).

Every message carries the rollout's epoch: a shard reset for the next rollout (`reset(epoch)`)
drops pushes and answers no pulls of another epoch, so a push still in flight from the last
rollout (group ids repeat across rollouts) cannot enter the new one's logs.

A shard that fails (its link raises `ShardDownError`) is marked down: the replica goes on
drafting from what it holds and stops sending to it. `replace_shard` installs a rebuilt one:
the replica re-sends every token it holds of that shard's groups (rebuild from the replicas)
and pulls the shard's log again from version 0 (each token is applied once).
"""

from __future__ import annotations

import collections
import dataclasses
import time
import zlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from seer_jax.drafting.arena import ArenaDraftContext
from seer_jax.drafting.context import DraftConfig
from seer_jax.drafting.draft import Draft
from seer_jax.drafting.service import DraftAppend, DraftQuery, GroupUpdate, _speculate
from seer_jax.errors import ConfigError, SeerError

_MSG_OVERHEAD = 16  # bytes a message costs besides its tokens and ids (start, lengths)


def shard_of(group_id: str, shards: int) -> int:
    """The shard holding a group (stable across processes: crc32, not Python's hash)."""
    return zlib.crc32(group_id.encode()) % shards


def message_bytes(msgs: Sequence[DraftAppend]) -> int:
    """What a batch of appends weighs on the wire (tokens, ids, header), for the sync stats."""
    return sum(m.token_ids.nbytes + len(m.group_id) + len(m.request_id or "") + _MSG_OVERHEAD
               for m in msgs)


@dataclasses.dataclass(frozen=True)
class SyncConfig:
    """How replicas sync with the shards (the `draft_service.*` keys of a rollout config).

    shards: draft-service shards (groups hashed over them); max_stale_steps: a pull is waited
    for once it is this many steps old (0: every step waits for its pull, the synchronous
    service); sync_every_steps: steps between two pushes/pulls of a replica."""

    shards: int = 1
    max_stale_steps: int = 1
    sync_every_steps: int = 1
    pull_timeout_s: float = 30.0  # a pull (or a shard ping) waited for longer: the shard is down

    def validate(self, prefix: str = "draft_service.") -> SyncConfig:
        def bad(key, allowed):
            raise ConfigError(f"{prefix}{key}={getattr(self, key)!r} is invalid: {allowed}")

        if not isinstance(self.shards, int) or isinstance(self.shards, bool) or self.shards < 1:
            bad("shards", "allowed: an integer >= 1")
        if (not isinstance(self.max_stale_steps, int) or isinstance(self.max_stale_steps, bool)
                or self.max_stale_steps < 0):
            bad("max_stale_steps", "allowed: an integer >= 0 (0 = wait for every pull)")
        if (not isinstance(self.sync_every_steps, int) or isinstance(self.sync_every_steps, bool)
                or self.sync_every_steps < 1):
            bad("sync_every_steps", "allowed: an integer >= 1")
        t = self.pull_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            bad("pull_timeout_s", "allowed: a number of seconds > 0")
        return self

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], prefix: str = "draft_service.") -> SyncConfig:
        """A validated SyncConfig of config keys (ConfigError naming an unknown or bad key)."""
        keys = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(keys))
        if unknown:
            raise ConfigError(f"{prefix}{unknown[0]} is unknown; allowed keys: {', '.join(keys)}")
        return cls(**d).validate(prefix)

    def max_lag_steps(self) -> int:
        """The most steps a replica's drafts can lack a token another instance generated, with
        instances stepping together and every pull as late as allowed. With k =
        sync_every_steps and m = max_stale_steps: the token is pushed up to k - 1 steps after
        its step; a pull issued in the same step as that push may miss it; pulls start at most
        P = k * ceil((m + 1) / k) steps apart (one in flight per shard, the next at the first
        sync step after the last was applied) and each is applied at most m steps after it was
        issued. So P + m + k - 1: 3 with the defaults (k = m = 1). With pulls answered within a
        step it is 2k - 1."""
        k, m = self.sync_every_steps, self.max_stale_steps
        return k * -(-(m + 1) // k) + m + k - 1


class ShardDownError(SeerError):
    """A draft-service shard did not answer (dead, or past the pull timeout)."""


class DraftShard:
    """One shard of the draft service: the append log of its groups (see module docstring).
    Plain Python: `rollout.backends.ray_draft_service` runs it as a Ray actor."""

    def __init__(self, epoch: int = 0) -> None:
        self._logs: dict[str, list[DraftAppend]] = {}
        self._have: dict[str, dict[str | None, int]] = {}
        self._held: dict[str, list[DraftAppend]] = {}  # messages past a gap, per group
        self._closed: set[str] = set()  # groups closed in this epoch (late messages dropped)
        self.epoch = epoch  # the rollout this shard serves (`reset`)
        self.received = 0  # messages received
        self.bytes_received = 0
        self.stale_dropped = 0  # messages of another epoch dropped

    def append_batch(self, appends: Sequence[DraftAppend], epoch: int = 0) -> int:
        """Apply appends (each token once, by position); returns how many tokens were new.
        Appends of another epoch than the shard's (a rollout before its last reset) are
        dropped."""
        if epoch != self.epoch:
            self.stale_dropped += len(appends)
            return 0
        self.received += len(appends)
        self.bytes_received += message_bytes(appends)
        new = 0
        for msg in appends:
            if msg.group_id in self._closed:
                continue
            new += self._append(msg)
        return new

    def _append(self, msg: DraftAppend) -> int:
        have = self._have.setdefault(msg.group_id, {})
        cut = _novel(msg, have)
        if cut is _GAP:
            self._held.setdefault(msg.group_id, []).append(msg)
            return 0
        if cut is None:
            return 0
        self._logs.setdefault(msg.group_id, []).append(cut)
        new = len(cut.token_ids)
        held = self._held.get(msg.group_id)
        while held:  # the gap before a held message may be filled now
            ready = [m for m in held if m.request_id == msg.request_id
                     and m.start <= have.get(m.request_id, 0)]
            if not ready:
                break
            for m in ready:
                held.remove(m)
                part = _novel(m, have)
                if part is not None and part is not _GAP:
                    self._logs[msg.group_id].append(part)
                    new += len(part.token_ids)
        if held == []:
            del self._held[msg.group_id]
        return new

    def sync(self, group_ids: Sequence[str], since: Mapping[str, int],
             epoch: int = 0) -> list[GroupUpdate]:
        """The appends after `since[g]` of each group; a version beyond the log (a replica of
        a shard this one replaced) gets the whole log. A replica of another epoch gets
        nothing."""
        if epoch != self.epoch:
            return []
        out = []
        for gid in group_ids:
            log = self._logs.get(gid, [])
            s = since.get(gid, 0)
            s = 0 if not 0 <= s <= len(log) else s
            out.append(GroupUpdate(gid, s, len(log), tuple(log[s:])))
        return out

    def close_groups(self, group_ids: Sequence[str], epoch: int | None = None) -> None:
        """Forget these groups (their rollout is done with them); their late appends are
        dropped until the next `reset`. A call of another epoch than the shard's is ignored."""
        if epoch is not None and epoch != self.epoch:
            return
        for gid in group_ids:
            self._logs.pop(gid, None)
            self._have.pop(gid, None)
            self._held.pop(gid, None)
            self._closed.add(gid)

    def reset(self, epoch: int | None = None) -> None:
        """Empty the logs for the next rollout, `epoch` (default: the next one)."""
        self._logs.clear()
        self._have.clear()
        self._held.clear()
        self._closed.clear()
        self.epoch = self.epoch + 1 if epoch is None else epoch

    def stats(self) -> dict[str, int]:
        return {"groups": len(self._logs), "messages": sum(len(v) for v in self._logs.values()),
                "tokens": sum(len(m.token_ids) for v in self._logs.values() for m in v),
                "held": sum(len(v) for v in self._held.values()),
                "received": self.received, "bytes_received": self.bytes_received,
                "epoch": self.epoch, "stale_dropped": self.stale_dropped}

    def ping(self) -> bool:
        return True


_GAP: Any = object()  # `_novel`: the message starts past what is held of its request


def _novel(msg: DraftAppend, have: dict[str | None, int]) -> DraftAppend | None:
    """The part of `msg` not in `have` yet (tokens per request, the prompt under None), with
    `have` advanced; None when nothing is new; `_GAP` (`have` unchanged) when it starts past
    the end of what is held, so tokens would be missing between the two. A prompt is set
    once."""
    n = have.get(msg.request_id, 0)
    if msg.request_id is None:
        if n or not len(msg.token_ids):
            return None
        have[None] = len(msg.token_ids)
        return DraftAppend(msg.group_id, None, msg.token_ids, 0)
    start = n if msg.start < 0 else msg.start
    end = start + len(msg.token_ids)
    if end <= n or not len(msg.token_ids):
        return None
    if start > n:
        return _GAP
    cut = n - start
    have[msg.request_id] = end
    return DraftAppend(msg.group_id, msg.request_id, msg.token_ids[cut:], start + cut)


class ShardLink(Protocol):
    """A replica's transport to one shard."""

    def push(self, appends: list[DraftAppend], epoch: int) -> None:
        """Send appends of rollout `epoch` (returns at once; a failure shows at the next
        `poll`)."""

    def pull(self, group_ids: list[str], since: dict[str, int], epoch: int) -> Any:
        """Start a sync; returns a handle for `poll`."""

    def poll(self, handle: Any, wait: bool, timeout_s: float) -> list[GroupUpdate] | None:
        """The sync's updates; None when not arrived and not `wait`. Raises ShardDownError."""


@dataclasses.dataclass
class ReplicaStats:
    steps: int = 0
    pushes: int = 0
    pulls: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    remote_tokens: int = 0  # other instances' tokens applied from pulls
    waited_pulls: int = 0  # pulls that were not in when due (the step waited)
    wait_s: float = 0.0  # time spent waiting for due pulls
    sync_s: float = 0.0  # host time pushing, polling and applying pulls (waits included)
    draft_s: float = 0.0  # host time drafting
    pull_latency_s: float = 0.0  # issue -> applied, summed over pulls
    shard_failures: int = 0
    shards_replaced: int = 0
    resyncs: int = 0  # groups pulled again from version 0 after a gap


class SyncedReplica:
    """The local replica an engine drafts from (see module docstring); a `DraftService` for
    `Speculator`."""

    def __init__(self, links: Sequence[ShardLink], sync: SyncConfig | None = None,
                 config: DraftConfig | None = None, epoch: int = 0) -> None:
        self.sync_config = (sync or SyncConfig(shards=len(links))).validate()
        if len(links) != self.sync_config.shards:
            raise ConfigError(f"draft_service.shards={self.sync_config.shards} but "
                              f"{len(links)} shard links were given")
        self.config = (config or DraftConfig()).validate()
        self.links: list[ShardLink] = list(links)
        self.epoch = epoch  # the rollout's epoch, carried by every push and pull
        self.down: set[int] = set()
        self._ctx: dict[str, ArenaDraftContext] = {}
        self._tokens: dict[str, dict[str | None, list[int]]] = {}  # what the local contexts hold
        self._pos: dict[tuple[str, str], int] = {}  # the engine's next output position
        self._versions: dict[str, int] = {}  # shard log version applied, per group
        self._active: dict[str, set[str]] = collections.defaultdict(set)
        self._group_of: dict[str, str] = {}
        self._closed: set[str] = set()  # groups closed in this epoch
        self._outbox: list[list[DraftAppend]] = [[] for _ in links]
        self._pending: collections.deque = collections.deque()  # (step issued, shard, handle, t)
        self.stats = ReplicaStats()

    # ---- the DraftService surface the Speculator uses -------------------------------------------
    def append(self, group_id: str, request_id: str | None, token_ids) -> int:
        if group_id in self._closed:
            return 0  # a closed group's late tokens (no request of it runs any more)
        toks = [int(t) for t in token_ids]
        start = 0 if request_id is None else self._pos.get((group_id, request_id),
                                                           self._have(group_id, request_id))
        msg = DraftAppend.make(group_id, request_id, toks, start)
        self._apply(msg)
        if request_id is not None:
            self._pos[(group_id, request_id)] = start + len(toks)
        self._outbox[shard_of(group_id, len(self.links))].append(msg)
        return 0

    def append_batch(self, appends: Sequence[DraftAppend]) -> None:
        for m in appends:
            self.append(m.group_id, m.request_id, m.token_ids)

    def speculate(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        t0 = time.perf_counter()
        out = _speculate(self._ctx, queries)
        self.stats.draft_s += time.perf_counter() - t0
        return out

    def finish_request(self, group_id: str, request_id: str) -> None:
        ctx = self._ctx.get(group_id)
        if ctx is not None:
            ctx.finish_request(request_id)
        self._end_chunk(group_id, request_id)

    def close_group(self, group_id: str) -> None:
        """Forget a group whose requests have all finished (late pulls and appends of it are
        dropped until `clear`)."""
        for d in (self._ctx, self._tokens, self._versions):
            d.pop(group_id, None)
        for rid in self._active.pop(group_id, ()):
            self._pos.pop((group_id, rid), None)
            self._group_of.pop(rid, None)
        for key in [k for k in self._pos if k[0] == group_id]:
            del self._pos[key]
        self._outbox = [[m for m in box if m.group_id != group_id] for box in self._outbox]
        self._closed.add(group_id)

    def close_groups(self, group_ids: Sequence[str]) -> None:
        for gid in group_ids:
            self.close_group(gid)

    # ---- the engine actor's hooks ---------------------------------------------------------------
    def start_request(self, group_id: str, request_id: str, prompt_ids: Sequence[int],
                      output_ids: Sequence[int]) -> None:
        """A chunk of a request starts here: the local context gets the tokens the chunk brings
        that it has not seen (a request migrated from an instance whose appends are not pulled
        yet), and the request's group is pulled while it runs."""
        self._closed.discard(group_id)
        self._apply(DraftAppend.make(group_id, None, prompt_ids, 0))
        out = [int(t) for t in output_ids]
        have = self._have(group_id, request_id)
        if have < len(out):
            self._apply(DraftAppend.make(group_id, request_id, out[have:], have))
        self._pos[(group_id, request_id)] = len(out)
        self._active[group_id].add(request_id)
        self._group_of[request_id] = group_id

    def abort(self, request_id: str) -> None:
        gid = self._group_of.get(request_id)
        if gid is not None:
            self._end_chunk(gid, request_id)

    def _end_chunk(self, group_id: str, request_id: str) -> None:
        """A chunk ended here: its group is no longer pulled for it."""
        reqs = self._active.get(group_id)
        if reqs is not None:
            reqs.discard(request_id)
            if not reqs:
                del self._active[group_id]
        self._pos.pop((group_id, request_id), None)
        self._group_of.pop(request_id, None)

    def before_step(self) -> None:
        """Apply the pulls that arrived; wait for those due (see module docstring)."""
        t0 = time.perf_counter()
        step = self.stats.steps
        keep: collections.deque = collections.deque()
        while self._pending:
            issued, k, handle, t_issue = self._pending.popleft()
            if k in self.down:
                continue
            due = step - issued >= self.sync_config.max_stale_steps
            tw = time.perf_counter()
            try:
                ups = self.links[k].poll(handle, due, self.sync_config.pull_timeout_s)
            except ShardDownError:
                self._shard_down(k)
                continue
            if ups is None:
                keep.append((issued, k, handle, t_issue))
                continue
            if due and time.perf_counter() - tw > 1e-4:
                self.stats.waited_pulls += 1
                self.stats.wait_s += time.perf_counter() - tw
            self._apply_updates(ups)
            self.stats.pull_latency_s += time.perf_counter() - t_issue
        self._pending = keep
        self.stats.sync_s += time.perf_counter() - t0

    def after_step(self) -> None:
        """Push this step's tokens (one message per shard) and start the next pulls."""
        t0 = time.perf_counter()
        self.stats.steps += 1
        if self.stats.steps % self.sync_config.sync_every_steps == 0:
            self._push_all()
            groups: dict[int, list[str]] = collections.defaultdict(list)
            for gid, reqs in self._active.items():
                if reqs:
                    groups[shard_of(gid, len(self.links))].append(gid)
            for k, gids in groups.items():
                if k in self.down or any(p[1] == k for p in self._pending):
                    continue  # one pull in flight per shard: the next one starts once it is in
                since = {g: self._versions.get(g, 0) for g in gids}
                self._pending.append((self.stats.steps, k,
                                      self.links[k].pull(gids, since, self.epoch),
                                      time.perf_counter()))
                self.stats.pulls += 1
        self.stats.sync_s += time.perf_counter() - t0

    def replace_shard(self, k: int, link: ShardLink) -> None:
        """A rebuilt shard `k`: re-send what this replica holds of its groups, pull from 0."""
        self.links[k] = link
        self.down.discard(k)
        self._pending = collections.deque(p for p in self._pending if p[1] != k)
        self.stats.shards_replaced += 1
        msgs = []
        for gid, reqs in self._tokens.items():
            if shard_of(gid, len(self.links)) != k:
                continue
            self._versions[gid] = 0
            msgs += [DraftAppend.make(gid, rid, toks, 0) for rid, toks in
                     sorted(reqs.items(), key=lambda kv: kv[0] is not None) if toks]
        self._outbox[k] = msgs + self._outbox[k]

    def clear(self, epoch: int | None = None) -> None:
        """Forget every group (a new rollout, `epoch` when given; the shard links stay, the
        stats go on)."""
        if epoch is not None:
            self.epoch = epoch
        for d in (self._ctx, self._tokens, self._pos, self._versions, self._active,
                  self._group_of, self._closed):
            d.clear()
        self._outbox = [[] for _ in self.links]
        self._pending.clear()

    def status(self) -> dict:
        """Stats and the shards found down (the controller rebuilds those)."""
        return {**dataclasses.asdict(self.stats), "down": sorted(self.down),
                "groups": len(self._ctx)}

    # ---- internals ------------------------------------------------------------------------------
    def _have(self, group_id: str, request_id: str | None) -> int:
        return len(self._tokens.get(group_id, {}).get(request_id, ()))

    def _apply(self, msg: DraftAppend) -> int:
        """Apply the novel part of a message to the local context; returns its token count
        (-1: a gap, nothing applied)."""
        reqs = self._tokens.setdefault(msg.group_id, {})
        cut = _novel(msg, {msg.request_id: len(reqs.get(msg.request_id, ()))})
        if cut is _GAP:
            return -1
        if cut is None:
            return 0
        ctx = self._ctx.get(msg.group_id)
        if ctx is None:
            ctx = self._ctx[msg.group_id] = ArenaDraftContext(self.config)
        toks = cut.token_ids.tolist()
        if cut.request_id is None:
            if ctx.request_ids:  # responses arrived first (pulled before the prompt): keep them
                return 0
            ctx.set_prompt(toks)
        else:
            ctx.append(cut.request_id, toks)
        reqs.setdefault(cut.request_id, []).extend(toks)
        return len(toks)

    def _apply_updates(self, updates: Sequence[GroupUpdate]) -> None:
        for up in updates:
            if up.group_id in self._closed or (up.group_id not in self._tokens
                                               and up.group_id not in self._active):
                continue  # closed meanwhile
            self.stats.bytes_pulled += message_bytes(up.appends)
            gap = False
            for m in up.appends:
                n = self._apply(m)
                gap |= n < 0
                self.stats.remote_tokens += max(n, 0)
            # a gap (tokens this replica lacks before a message): pull the whole log again
            self._versions[up.group_id] = 0 if gap else up.version
            self.stats.resyncs += gap

    def _push_all(self) -> None:
        for k, msgs in enumerate(self._outbox):
            if not msgs:
                continue
            self._outbox[k] = []
            if k in self.down:
                continue  # re-sent from the local contexts when the shard is replaced
            self.links[k].push(msgs, self.epoch)
            self.stats.pushes += 1
            self.stats.bytes_pushed += message_bytes(msgs)

    def _shard_down(self, k: int) -> None:
        if k not in self.down:
            self.down.add(k)
            self.stats.shard_failures += 1
        self._outbox[k] = []


class LocalShardLink:
    """A `ShardLink` to a `DraftShard` in this process. `delay_polls`: each pull answers None
    to that many `poll(wait=False)` calls first (a replica kept stale on purpose, in tests);
    `dead`: the shard is gone (polls raise ShardDownError, pushes are lost)."""

    def __init__(self, shard: DraftShard, delay_polls: int = 0) -> None:
        self.shard = shard
        self.delay_polls = delay_polls
        self.dead = False

    def push(self, appends: list[DraftAppend], epoch: int = 0) -> None:
        if not self.dead:
            self.shard.append_batch(appends, epoch)

    def pull(self, group_ids: list[str], since: dict[str, int], epoch: int = 0) -> Any:
        return [None if self.dead else self.shard.sync(group_ids, since, epoch), 0]

    def poll(self, handle: Any, wait: bool, timeout_s: float) -> list[GroupUpdate] | None:
        if self.dead or handle[0] is None:
            raise ShardDownError("draft-service shard is down")
        handle[1] += 1
        if not wait and handle[1] <= self.delay_polls:
            return None
        return list(handle[0])
