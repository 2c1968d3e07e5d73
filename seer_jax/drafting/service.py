"""The draft service: message-shaped access to group draft contexts.

Engines append generated tokens in batches and fetch drafts for their active requests. Every call
takes and returns plain messages (dataclasses of strings, ints and int32 arrays), so the contexts
can live in another process (a Ray actor, the controller) without changing callers:

- `append(group_id, request_id, token_ids)` / `append_batch([DraftAppend, ...])`: add tokens
  (request_id None = the group's prompt, before any response token);
- `sync(group_ids, since_version)` -> `[GroupUpdate]`: the appends a replica has not seen yet
  (version = number of append messages the group has received);
- `speculate([DraftQuery, ...])` -> `[Draft]`.

`InProcessDraftService` holds the contexts. `DraftReplica` mirrors chosen groups of any service
through `sync` and drafts locally (the paper's instances fetching incremental updates from the
grouped draft server), forwarding its appends to the source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from seer_jax.drafting.arena import Arena, ArenaDraftContext
from seer_jax.drafting.context import DraftConfig
from seer_jax.drafting.draft import Draft
from seer_jax.drafting.draft_rows import DraftRows
from seer_jax.errors import InputError


def _tokens(token_ids: Iterable[int]) -> np.ndarray:
    arr = np.asarray(token_ids if isinstance(token_ids, np.ndarray) else list(token_ids))
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InputError(f"token_ids must be a 1-D sequence of ints, got shape {arr.shape}")
    return arr.astype(np.int32, copy=False)


@dataclasses.dataclass(frozen=True)
class DraftAppend:
    """Tokens appended to a request of a group (request_id None: the group's prompt).
    start: where token_ids[0] sits in the request's output (the prompt: 0), so a replica can
    apply a message it partly has already exactly once; -1 = at the end (position unknown)."""

    group_id: str
    request_id: str | None
    token_ids: np.ndarray  # int32 [n]
    start: int = -1

    @staticmethod
    def make(group_id: str, request_id: str | None, token_ids: Iterable[int],
             start: int = -1) -> DraftAppend:
        return DraftAppend(group_id, request_id, _tokens(token_ids), start)


@dataclasses.dataclass(frozen=True)
class DraftQuery:
    """Ask for a draft for one request: ≤ max_nodes nodes, paths ≤ max_depth, top-`width`
    branches at forks (1 = chain); min_prob None = the service's configured value."""

    group_id: str
    request_id: str
    max_nodes: int = 8
    max_depth: int = 8
    width: int = 1
    min_prob: float | None = None


@dataclasses.dataclass(frozen=True)
class GroupUpdate:
    """The appends of a group with versions in (since_version, version]."""

    group_id: str
    since_version: int
    version: int
    appends: tuple[DraftAppend, ...]


@runtime_checkable
class DraftService(Protocol):
    def append(self, group_id: str, request_id: str | None, token_ids: Iterable[int]) -> int:
        """Append tokens; returns the group's new version."""

    def append_batch(self, appends: Sequence[DraftAppend]) -> None:
        """Apply several appends in order."""

    def sync(
        self, group_ids: Sequence[str], since_version: int | Mapping[str, int] = 0
    ) -> list[GroupUpdate]:
        """The appends after `since_version` (one int for all groups, or per group)."""

    def speculate(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        """One draft per query (empty drafts for unknown groups or nothing to draft from)."""

    def close_group(self, group_id: str) -> None:
        """Forget a group (its rollout is over)."""


class InProcessDraftService:
    """Draft contexts held in this process (see module docstring).

    keep_log: keep every append message so `sync` can serve replicas (memory: the group's tokens
      once more, as int32). Off by default: only replicas need it.
    max_groups: contexts kept; beyond it the least recently written group is closed (a service
      shared by engines a trainer keeps alive must not grow with every rollout it ever served).
    """

    def __init__(self, config: DraftConfig | None = None, keep_log: bool = False,
                 max_groups: int = 8192) -> None:
        if max_groups < 1:
            raise InputError(f"max_groups={max_groups} is invalid; allowed: >= 1")
        self.config = (config or DraftConfig()).validate()
        self.keep_log = keep_log
        self.max_groups = max_groups
        self._groups: dict[str, ArenaDraftContext] = {}  # least recently written first
        self._arena = Arena()  # every group's automata: one compiled call for all of them
        self._logs: dict[str, list[DraftAppend]] = {}
        self._versions: dict[str, int] = {}

    # -- writes ----------------------------------------------------------------------------------

    def _context(self, group_id: str) -> ArenaDraftContext:
        """The group's context, made the most recently written (created, closing the least
        recently written group beyond max_groups, if new)."""
        ctx = self._groups.pop(group_id, None)
        if ctx is None:
            while len(self._groups) >= self.max_groups:
                self.close_group(next(iter(self._groups)))
            ctx = ArenaDraftContext(self.config, arena=self._arena)
            self._logs[group_id] = []
            self._versions[group_id] = 0
        self._groups[group_id] = ctx
        return ctx

    def _record(self, msg: DraftAppend) -> int:
        if self.keep_log:
            self._logs[msg.group_id].append(msg)
        self._versions[msg.group_id] += 1
        return self._versions[msg.group_id]

    def append(self, group_id: str, request_id: str | None, token_ids: Iterable[int]) -> int:
        msg = DraftAppend.make(group_id, request_id, token_ids)
        ctx = self._context(group_id)
        if request_id is None:
            ctx.set_prompt(msg.token_ids.tolist())
        else:
            ctx.append(request_id, msg.token_ids)
        return self._record(msg)

    def append_batch(self, appends: Sequence[DraftAppend]) -> None:
        """The appends in order; each group's response tokens go to its context in one call."""
        pending: dict[int, tuple[ArenaDraftContext, list]] = {}
        for msg in appends:
            ctx = self._context(msg.group_id)
            if msg.request_id is None:
                _flush(pending.pop(id(ctx), None))
                ctx.set_prompt(msg.token_ids.tolist())
            else:
                pending.setdefault(id(ctx), (ctx, []))[1].append((msg.request_id, msg.token_ids))
            self._record(msg)
        for item in pending.values():
            _flush(item)

    def append_rows(self, rows: Sequence[tuple[str, str, list[int]]]) -> None:
        """Response tokens [(group_id, request_id, token ids)] of trusted callers (the
        engine's ints): `append_batch` without a message per row unless the log is kept."""
        if self.keep_log:
            self.append_batch([DraftAppend(g, r, np.array(t, np.int32)) for g, r, t in rows])
            return
        groups = self._groups
        if not all(g in groups for g, _, _ in rows):  # a new group: row by row (its LRU closes)
            pending: dict[int, tuple[ArenaDraftContext, list]] = {}
            for g, r, t in rows:
                ctx = self._context(g)
                pending.setdefault(id(ctx), (ctx, []))[1].append((r, t))
                self._versions[g] += 1
            for item in pending.values():
                _flush(item)
            return
        # every group's tokens in one compiled call; each group made the most recently written
        # in the order of its last row (as row by row)
        versions, last = self._versions, {}
        seqs: list[int] = []
        chunks: list = []
        for i, (g, r, t) in enumerate(rows):
            ctx = groups[g]
            tg = ctx._targets.get(r)
            if tg is None:
                tg = ctx.targets(r)
            for q in tg:
                seqs.append(q)
                chunks.append(t)
            versions[g] += 1
            last[g] = i
        for g in sorted(last, key=last.__getitem__):
            self._context(g)
        self._arena.extend(seqs, chunks)

    def finish_request(self, group_id: str, request_id: str) -> None:
        ctx = self._groups.get(group_id)
        if ctx is not None:
            ctx.finish_request(request_id)

    def close_group(self, group_id: str) -> None:
        ctx = self._groups.pop(group_id, None)
        if ctx is not None:
            ctx.close()
        self._logs.pop(group_id, None)
        self._versions.pop(group_id, None)

    def num_states(self) -> int:
        """States held for every group (released ones not yet compacted away included)."""
        return int(self._arena.meta[0])

    # -- reads -----------------------------------------------------------------------------------

    def version(self, group_id: str) -> int:
        return self._versions.get(group_id, 0)

    def context(self, group_id: str) -> ArenaDraftContext | None:
        return self._groups.get(group_id)

    def sync(
        self, group_ids: Sequence[str], since_version: int | Mapping[str, int] = 0
    ) -> list[GroupUpdate]:
        if not self.keep_log:
            raise InputError("this draft service keeps no append log (keep_log=False): no sync")
        out = []
        for gid in group_ids:
            since = since_version.get(gid, 0) if isinstance(since_version, Mapping) else since_version
            version = self._versions.get(gid, 0)
            if since > version or since < 0:
                raise InputError(f"group {gid!r}: since_version={since} outside [0, {version}]")
            log = self._logs.get(gid, [])
            out.append(GroupUpdate(gid, since, version, tuple(log[since:version])))
        return out

    def speculate(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        """The drafts of the queries, every group's in one compiled call."""
        n = len(queries)
        if not n:
            return []
        seqs = np.full((n, 2), -1, np.int64)
        groups = self._groups
        for i, q in enumerate(queries):
            ctx = groups.get(q.group_id)
            if ctx is not None:
                seqs[i] = ctx._seqs(q.request_id)
        mp = self.config.min_prob
        return list(self._arena.draft_rows(
            self.config, seqs, np.fromiter((q.max_nodes for q in queries), np.int64, n),
            np.fromiter((q.max_depth for q in queries), np.int64, n),
            np.fromiter((q.width for q in queries), np.int64, n),
            np.fromiter((mp if q.min_prob is None else q.min_prob for q in queries), np.float64, n)))

    def speculate_rows(self, rows: Sequence[tuple[str, str]], max_nodes: int, max_depth: int,
                       width: int) -> DraftRows:
        """`speculate` for [(group_id, request_id)] with one shape for all (no query objects),
        every group's rows in one compiled call, as `DraftRows` (no object per draft)."""
        n = len(rows)
        if not n:
            return DraftRows.empty([])
        groups, none = self._groups, (-1, -1)
        pairs = []
        for g, r in rows:
            ctx = groups.get(g)
            pairs.append(none if ctx is None else ctx._seqs(r))
        seqs = np.array(pairs, np.int64).reshape(n, 2)
        mp = self.config.min_prob
        return self._arena.draft_rows(self.config, seqs, np.full(n, max_nodes, np.int64),
                                  np.full(n, max_depth, np.int64), np.full(n, width, np.int64),
                                  np.full(n, mp, np.float64))


def _flush(item: tuple[ArenaDraftContext, list] | None) -> None:
    if item is not None:
        item[0].append_many(item[1])


def _speculate(groups: Mapping[str, ArenaDraftContext], queries: Sequence[DraftQuery]) -> list[Draft]:
    """The drafts of the queries, each group's in one call."""
    out: list[Draft | None] = [None] * len(queries)
    by_group: dict[str, list[int]] = {}
    for i, q in enumerate(queries):
        by_group.setdefault(q.group_id, []).append(i)
    for gid, rows in by_group.items():
        ctx = groups.get(gid)
        if ctx is None:
            for i in rows:
                out[i] = Draft.empty()
            continue
        drafts = ctx.speculate_many([(q.request_id, q.max_nodes, q.max_depth, q.width, q.min_prob)
                                     for q in (queries[i] for i in rows)])
        for i, d in zip(rows, drafts, strict=True):
            out[i] = d
    return out


class DraftReplica:
    """A local mirror of some groups of a `DraftService` (e.g. one per engine instance).

    `refresh(group_ids)` pulls the appends it has not seen; `speculate` drafts from the local
    mirror; `append` forwards to the source (the local view catches up at the next refresh).
    """

    def __init__(self, source: DraftService, config: DraftConfig | None = None) -> None:
        self.source = source
        self.config = (config or DraftConfig()).validate()
        self._groups: dict[str, ArenaDraftContext] = {}
        self._versions: dict[str, int] = {}

    def append(self, group_id: str, request_id: str | None, token_ids: Iterable[int]) -> int:
        return self.source.append(group_id, request_id, token_ids)

    def append_batch(self, appends: Sequence[DraftAppend]) -> None:
        self.source.append_batch(appends)

    def refresh(self, group_ids: Sequence[str]) -> int:
        """Apply the source's new appends for these groups; returns how many were applied."""
        updates = self.source.sync(list(group_ids), {g: self._versions.get(g, 0) for g in group_ids})
        applied = 0
        for up in updates:
            ctx = self._groups.get(up.group_id)
            if ctx is None:
                ctx = self._groups[up.group_id] = ArenaDraftContext(self.config)
            for msg in up.appends:
                if msg.request_id is None:
                    ctx.set_prompt(msg.token_ids.tolist())
                else:
                    ctx.append(msg.request_id, msg.token_ids.tolist())
            applied += len(up.appends)
            self._versions[up.group_id] = up.version
        return applied

    def version(self, group_id: str) -> int:
        return self._versions.get(group_id, 0)

    def sync(
        self, group_ids: Sequence[str], since_version: int | Mapping[str, int] = 0
    ) -> list[GroupUpdate]:
        return self.source.sync(group_ids, since_version)

    def speculate(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        return _speculate(self._groups, queries)

    def close_group(self, group_id: str) -> None:
        self._groups.pop(group_id, None)
        self._versions.pop(group_id, None)
