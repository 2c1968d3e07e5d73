"""The rollout journal: an append-only record of a rollout's progress, so a crashed controller's
rollout can be resumed instead of regenerated.

Format: one record per line, `<crc32 of the JSON, 8 hex digits> <JSON>\\n`. Every record is
written and flushed to the operating system as soon as it exists, so a killed process loses
nothing it had recorded (with `fsync=True` each record also reaches the disk before the rollout
goes on, which survives a host crash too, at a cost per record). A last line that is cut short or
whose checksum does not match (the process died while writing it) is ignored and cut off when
the journal is reopened; a damaged record *before* the last one is refused (`JournalError`), as
the records after it cannot be trusted.

Records (`t` is the kind):
- `h` header, first: `format` and `fingerprint`, a flat dict of everything a resumed rollout
  must share with the one that wrote the journal (model identity, prompts, group size, sampling,
  max_tokens, policies, seed...). Resuming under a different fingerprint is refused with a
  `JournalMismatchError` naming each key that differs.
- `c` chunk end: policy `p`, request `r`, its token count so far `n`, the chunk's tokens `tok`,
  logprobs `lp` and the weight version `v` they were generated under.
- `f` finished response: policy, request, every token and logprob, finish reason `fr`, the
  weight-version segments `wv` ([version, tokens] pairs), finish time `at` and chunk count `ch`.
- `p` policy done: the policy's rollout report `report`, so a finished rollout is returned
  without running anything.

One rollout writes a journal directory at a time: `JournalLock` holds an exclusive `flock` on
its `rollout.journal.lock` for the run's life (a second rollout or resume of the directory fails
at once, naming it, `JournalLockedError`; the lock goes with the process, however it ends). A new
journal is created exclusively (O_EXCL), never over an existing one.

`JournalWriter` writes; `read_journal` parses a file into a `JournalState` (per policy: finished
responses, unfinished prefixes, the report when done), which the controller restores
(`Controller.restore`).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pathlib
import time
import zlib
from collections.abc import Mapping
from typing import Any

from seer_jax.errors import ConfigError, SeerError

FORMAT = 1
JOURNAL_FILE = "rollout.journal"
LOCK_FILE = "rollout.journal.lock"


class JournalError(SeerError):
    """A journal that cannot be read or written (missing, damaged before its last record)."""


class JournalLockedError(JournalError):
    """Another process is writing (or resuming) the journal directory."""


class JournalLock:
    """An exclusive lock on a journal directory (created if missing) for as long as this
    object is held: `flock` on its lock file, which records the holder's pid. Another holder,
    in this process or any other, gets JournalLockedError naming the directory."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = pathlib.Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise JournalLockedError(
                f"journal directory {os.fspath(directory)!r} is in use by another rollout "
                f"(process {holder or '?'} holds {self.path}); wait for it to end, or give this "
                "rollout another journal_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


class JournalMismatchError(ConfigError):
    """A journal written by a different rollout (its fingerprint differs)."""


@dataclasses.dataclass
class RequestRecord:
    """What the journal (or a carried-over rollout) knows about one request: its tokens so far
    and, once it finished, its finish reason. `weight_versions`: [version, tokens] segments, in
    order, summing to len(token_ids)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[list[int]]
    finish_reason: str | None = None
    finished_at: float = 0.0
    num_chunks: int = 0
    # per token [MoE layer][k] expert ids, when the rollout returns them
    routed_experts: list[list[list[int]]] | None = None


@dataclasses.dataclass
class PolicyJournal:
    requests: dict[str, RequestRecord] = dataclasses.field(default_factory=dict)
    report: dict | None = None  # the policy's report once its rollout finished

    @property
    def done(self) -> bool:
        return self.report is not None


@dataclasses.dataclass
class JournalState:
    path: pathlib.Path
    fingerprint: dict
    policies: dict[str, PolicyJournal]
    records: int  # whole records read
    good_bytes: int  # length of the whole records; anything after is a torn last record
    dropped_tail: bool  # a torn or corrupt last record was found (and is ignored)

    def policy(self, name: str) -> PolicyJournal:
        return self.policies.setdefault(name, PolicyJournal())


def encode(record: Mapping[str, Any]) -> bytes:
    payload = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(payload) + payload + b"\n"


def _decode(line: bytes) -> dict | None:
    """The record of one whole line (newline included), or None when it is damaged."""
    if len(line) < 11 or not line.endswith(b"\n") or line[8:9] != b" ":
        return None
    payload = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(payload):
            return None
        rec = json.loads(payload)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "t" in rec else None


def read_journal(directory: str | os.PathLike) -> JournalState:
    """Parse `directory`'s journal (JournalError when it has none, or is damaged before its last
    record)."""
    path = pathlib.Path(directory) / JOURNAL_FILE
    if not path.is_file():
        raise JournalError(f"no rollout journal in {os.fspath(directory)!r} (expected {path})")
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    state = JournalState(path, {}, {}, 0, 0, False)
    for i, line in enumerate(lines):
        rec = _decode(line)
        if rec is None:
            if i == len(lines) - 1:
                state.dropped_tail = True
                break
            raise JournalError(f"{path}: record {i + 1} (byte {state.good_bytes}) is damaged and "
                               f"{len(lines) - i - 1} record(s) follow it; the journal cannot be "
                               "resumed")
        if i == 0:
            if rec.get("t") != "h" or rec.get("format") != FORMAT:
                raise JournalError(f"{path}: not a format-{FORMAT} rollout journal (first record "
                                   f"{str(rec)[:80]!r})")
            state.fingerprint = dict(rec["fingerprint"])
        else:
            _apply(state, rec, path, i + 1)
        state.records += 1
        state.good_bytes += len(line)
    if state.records == 0:
        raise JournalError(f"{path}: no whole header record; start the rollout again without "
                           "resuming")
    return state


def _apply(state: JournalState, rec: dict, path: pathlib.Path, lineno: int) -> None:
    kind = rec["t"]
    pol = state.policy(rec.get("p", ""))
    if kind == "c":
        r = pol.requests.get(rec["r"])
        if r is None:
            r = pol.requests[rec["r"]] = RequestRecord(rec["r"], [], [], [])
        r.token_ids.extend(rec["tok"])
        r.logprobs.extend(rec["lp"])
        if "re" in rec:
            r.routed_experts = (r.routed_experts or []) + list(rec["re"])
        add_segment(r.weight_versions, rec["v"], len(rec["tok"]))
        r.num_chunks += 1
        if len(r.token_ids) != rec["n"] or r.finish_reason is not None:
            raise JournalError(f"{path}: record {lineno}: chunk of {rec['r']!r} ends at token "
                               f"{rec['n']} but the journal holds {len(r.token_ids)} tokens"
                               + (" (request already finished)" if r.finish_reason else ""))
    elif kind == "f":
        pol.requests[rec["r"]] = RequestRecord(rec["r"], list(rec["tok"]), list(rec["lp"]),
                                               [list(s) for s in rec["wv"]], rec["fr"],
                                               float(rec["at"]), int(rec["ch"]), rec.get("re"))
    elif kind == "p":
        pol.report = rec["report"]
    else:
        raise JournalError(f"{path}: record {lineno} has unknown kind {kind!r}")


def add_segment(segments: list[list[int]], version: int, n: int) -> None:
    if n <= 0:
        return
    if segments and segments[-1][0] == version:
        segments[-1][1] += n
    else:
        segments.append([version, n])


def check_fingerprint(saved: Mapping[str, Any], current: Mapping[str, Any], path) -> None:
    """JournalMismatchError naming every key whose value differs between the journal and now."""
    diffs = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if a != b:
            diffs.append(f"{key}: journal {_short(a)}, now {_short(b)}")
    if diffs:
        raise JournalMismatchError(
            f"journal {os.fspath(path)!r} was written by a different rollout, so it cannot be "
            f"resumed; mismatched: {'; '.join(diffs)}")


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


class JournalWriter:
    """Appends records to a journal file (created with its header, or reopened to go on after
    the last whole record of an existing one). Implements the controller's journal hooks for one
    policy at a time (`for_policy`). It holds the directory's `JournalLock` until `close` (the
    one given, taken before the journal it resumes was read, or its own)."""

    def __init__(self, directory: str | os.PathLike, fingerprint: Mapping[str, Any] | None = None,
                 resume: JournalState | None = None, fsync: bool = False,
                 lock: JournalLock | None = None):
        self.lock = lock if lock is not None else JournalLock(directory)
        self.dir = pathlib.Path(directory)
        self.path = self.dir / JOURNAL_FILE
        self.fsync = fsync
        self.records = 0
        self.bytes = 0
        self.write_s = 0.0  # time spent encoding and writing records
        self.policy = ""
        try:
            if resume is None:
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    raise ConfigError(f"journal_dir={os.fspath(directory)!r} already holds a "
                                      "rollout journal; resume it (seer-jax rollout --resume "
                                      "DIR) or pick an empty directory") from None
                self._f = os.fdopen(fd, "wb")
                self._write({"t": "h", "format": FORMAT, "fingerprint": dict(fingerprint or {})})
            else:
                self._f = open(self.path, "r+b")
                self._f.truncate(resume.good_bytes)  # drop a torn last record before appending
                self._f.seek(resume.good_bytes)
        except BaseException:
            self.lock.release()
            raise

    def for_policy(self, policy: str) -> JournalWriter:
        self.policy = policy
        return self

    def chunk_end(self, request_id: str, total: int, tokens: list[int], logprobs: list[float],
                  version: int, routed_experts: list | None = None) -> None:
        rec = {"t": "c", "p": self.policy, "r": request_id, "n": total, "tok": tokens,
               "lp": logprobs, "v": version}
        if routed_experts is not None:
            rec["re"] = routed_experts
        self._write(rec)

    def finished(self, rec: RequestRecord) -> None:
        out = {"t": "f", "p": self.policy, "r": rec.request_id, "tok": rec.token_ids,
               "lp": rec.logprobs, "fr": rec.finish_reason, "wv": rec.weight_versions,
               "at": rec.finished_at, "ch": rec.num_chunks}
        if rec.routed_experts is not None:
            out["re"] = rec.routed_experts
        self._write(out)

    def policy_done(self, report: Mapping[str, Any]) -> None:
        self._write({"t": "p", "p": self.policy, "report": report})

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.lock.release()

    def _write(self, record: Mapping[str, Any]) -> None:
        t0 = time.perf_counter()
        line = encode(record)
        self._f.write(line)
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())
        self.write_s += time.perf_counter() - t0
        self.records += 1
        self.bytes += len(line)
