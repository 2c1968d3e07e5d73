"""The rollout journal on simulated instances: records, damaged tails, fingerprints, and resuming
from every prefix of a journal gives the uninterrupted rollout's responses; one rollout per
journal directory at a time."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from seer_jax.errors import ConfigError
from seer_jax.rollout.backends.kv_pool import HostKVPool
from seer_jax.rollout.core.journal import (
    JOURNAL_FILE,
    JournalError,
    JournalLock,
    JournalLockedError,
    JournalMismatchError,
    JournalWriter,
    check_fingerprint,
    encode,
    read_journal,
)
from seer_jax.rollout.core.run import rollout
from seer_jax.sim.instance import make_sim_instances
from tests.rollout.test_controller import workload

FINGERPRINT = {"model": "tiny", "max_tokens": 96, "group_size": 3}


def run(prompts, lengths, journal=None, restore=(), policy="seer"):
    pool = HostKVPool()
    insts = make_sim_instances(2, lengths, pool=pool, kv_capacity_pages=64, page_size=16)
    return rollout(prompts, group_size=3, max_tokens=96, instances=insts, policy=policy,
                   pool=pool, config={"chunk_size": 16}, journal=journal, restore=restore)


def key(results):
    return [(r.request_id, r.token_ids, r.logprobs, r.finish_reason) for r in results]


@pytest.fixture(scope="module")
def journaled(tmp_path_factory):
    """An uninterrupted journaled rollout: (prompts, lengths, its output, the journal's bytes)."""
    prompts, lengths = workload(5, 3, 96, seed=3)
    d = tmp_path_factory.mktemp("journal")
    w = JournalWriter(d, FINGERPRINT).for_policy("seer")
    out = run(prompts, lengths, journal=w)
    w.policy_done(out.report.to_json()["report"])
    w.close()
    return prompts, lengths, out, (d / JOURNAL_FILE).read_bytes()


def test_journal_records_every_response_and_chunk_end(journaled):
    prompts, lengths, out, data = journaled
    assert out.report.chunks > len(out.results)  # requests ran as several chunks
    state = read_journal_bytes(data)
    assert not state.dropped_tail and state.fingerprint == FINGERPRINT
    pj = state.policy("seer")
    assert pj.done and pj.report["chunks"] == out.report.chunks
    assert set(pj.requests) == {r.request_id for r in out.results}
    for r in out.results:
        rec = pj.requests[r.request_id]
        assert (rec.token_ids, rec.logprobs, rec.finish_reason) == (r.token_ids, r.logprobs,
                                                                      r.finish_reason)
        assert rec.weight_versions == [[0, len(r.token_ids)]] == r.weight_versions
    chunk_records = sum(line.split(b" ", 1)[1].startswith(b'{"t":"c"') for line in data.splitlines())
    assert chunk_records == out.report.chunks - len(out.results)  # one per unfinished chunk end


def read_journal_bytes(data: bytes, tmp=None):
    import pathlib
    import tempfile

    d = pathlib.Path(tmp or tempfile.mkdtemp())
    (d / JOURNAL_FILE).write_bytes(data)
    return read_journal(d)


def test_resume_from_every_record_prefix_and_torn_tail(journaled, tmp_path):
    """Cut the journal after each record (and in the middle of the next one): the resumed rollout
    returns the uninterrupted one's responses; finished ones are not generated again."""
    prompts, lengths, out, data = journaled
    lines = data.splitlines(keepends=True)
    for k in range(1, len(lines), 3):
        whole = b"".join(lines[:k])
        torn = whole + lines[k][: len(lines[k]) // 2] if k < len(lines) else whole
        d = tmp_path / f"cut{k}"
        d.mkdir()
        state = read_journal_bytes(torn, d)
        assert state.records == k and state.dropped_tail == (k < len(lines))
        restore = list(state.policy("seer").requests.values())
        w = JournalWriter(d, resume=state).for_policy("seer")
        res = run(prompts, lengths, journal=w, restore=restore)
        w.close()
        assert key(res.results) == key(out.results), k
        finished = sum(r.finish_reason is not None for r in restore)
        assert res.report.restored_responses == finished
        done = {r.request_id for r in restore if r.finish_reason is not None}
        partial = {r.request_id for r in restore if r.finish_reason is None and r.token_ids}
        for r in res.results:
            if r.request_id in done:  # returned as recorded: no chunk of it ran again
                assert r.instances == [], r.request_id
            elif r.request_id in partial:  # continued after its prefix, re-prefilled (no KV)
                assert r.instances and r.reprefill_tokens > 0, r.request_id
        # the journal was cut back to its whole records and continued: it now resumes to the end
        again = read_journal(d)
        assert not again.dropped_tail
        assert {rid: r.token_ids for rid, r in again.policy("seer").requests.items()} == {
            r.request_id: r.token_ids for r in out.results}


def test_damaged_record_before_the_last_is_refused(journaled, tmp_path):
    *_, data = journaled
    lines = data.splitlines(keepends=True)
    bad = lines[2].replace(b'"t":"', b'"t": "', 1)  # payload no longer matches its checksum
    with pytest.raises(JournalError, match=r"record 3 .* is damaged and \d+ record\(s\) follow"):
        read_journal_bytes(b"".join(lines[:2] + [bad] + lines[3:]), tmp_path)


def test_journal_refuses_to_overwrite_and_needs_a_header(tmp_path):
    JournalWriter(tmp_path, FINGERPRINT).close()
    with pytest.raises(ConfigError, match="already holds a rollout journal; resume it"):
        JournalWriter(tmp_path, FINGERPRINT)
    with pytest.raises(JournalError, match="no rollout journal in"):
        read_journal(tmp_path / "missing")
    (tmp_path / JOURNAL_FILE).write_bytes(encode({"t": "h", "format": 1, "fingerprint": {}})[:-3])
    with pytest.raises(JournalError, match="no whole header record"):
        read_journal(tmp_path)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD_LOCK = ("import sys; from seer_jax.rollout.core.journal import JournalLock; "
             "lock = JournalLock(sys.argv[1]); print('locked', flush=True); sys.stdin.read()")


def test_one_rollout_at_a_time_per_journal_directory(tmp_path):
    d = tmp_path / "journal"
    # another process holds the directory (a rollout writing or resuming it) ...
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(d)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert holder.stdout.readline() == "locked\n"
        # ... so a second rollout writing it, or resuming it, fails at once, naming it
        msg = (rf"journal directory {re.escape(repr(str(d)))} is in use by another rollout "
               rf"\(process {holder.pid} holds")
        with pytest.raises(JournalLockedError, match=msg):
            JournalWriter(d, FINGERPRINT)
        with pytest.raises(JournalLockedError, match=msg):
            JournalLock(d)
        assert not (d / JOURNAL_FILE).exists()
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the lock goes with the process
        holder.wait()
    w = JournalWriter(d, FINGERPRINT)
    with pytest.raises(JournalLockedError, match=f"process {os.getpid()} holds"):
        JournalLock(d)  # a second holder in the same process is refused too
    w.close()
    JournalLock(d).release()  # free once the writer is closed


def test_model_identity_hashes_every_byte_of_large_files(tmp_path):
    """A file over 256 MiB (sparse: cheap to make) whose byte in the middle changes, same path
    and size, has another identity."""
    from seer_jax.rollout.resume import file_identity

    model = tmp_path / "model"
    model.mkdir()
    f = model / "weights.bin"
    with open(f, "wb") as fh:
        fh.truncate(257 << 20)
    before = file_identity(model)
    with open(f, "r+b") as fh:
        fh.seek(128 << 20)
        fh.write(b"\1")
    assert f.stat().st_size == 257 << 20 and file_identity(model) != before


def test_fingerprint_mismatch_names_every_differing_key():
    check_fingerprint(FINGERPRINT, dict(FINGERPRINT), "j")
    with pytest.raises(JournalMismatchError,
                       match=r"mismatched: group_size: journal 3, now 4; model: journal 'tiny', "
                             r"now 'other'"):
        check_fingerprint(FINGERPRINT, {**FINGERPRINT, "model": "other", "group_size": 4}, "j")
