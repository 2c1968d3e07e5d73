"""Resuming a journaled rollout of real SmolLM2 engines: a `seer-jax rollout` process SIGKILLed
in the middle (deterministically, after N journal records) and resumed returns the responses of
an uninterrupted run; a torn last record, another config or model, and a finished journal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from seer_jax.config_files import load_config_file
from seer_jax.rollout.core.journal import (
    JOURNAL_FILE,
    KILL_AFTER_ENV,
    JournalMismatchError,
    read_journal,
)
from tests.subprocess_env import xla_flags_without_device_count

# real engines in subprocesses; one worker runs the module, so its uninterrupted run runs once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# greedy, small: 3 prompts x 2 samples x 24 tokens in chunks of 8 (so requests end chunks
# unfinished and the journal holds prefixes), one policy
OVERRIDES = ["--config.num_prompts=3", "--config.group_size=2", "--config.max_tokens=24",
             "--config.controller.chunk_size=8", "--config.policies=seer",
             "--config.temperature=0.0"]
# logprobs of a resumed request's later tokens come from a forward pass over a re-prefilled
# context instead of the incremental decode that made them in the uninterrupted run: the same
# math in a different order of float32 operations
LOGPROB_ATOL = 1e-4


def cli(tmp_path, name, *args, env=None):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, "-m", "seer_jax.cli", "rollout", "--config",
         os.path.join(ROOT, "configs/rollout/demo.py"), "--no-progress", "--json", str(out),
         *OVERRIDES, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "XLA_FLAGS": xla_flags_without_device_count(), "PYTHONPATH": ROOT,
             **(env or {})})  # the CLI asks for the CPU devices it needs
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def responses(report):
    return {r["request_id"]: r for r in report["responses"]}


def same_responses(got, want, exact=()):
    """Same tokens and finish reasons; logprobs within LOGPROB_ATOL, bit for bit for the
    request ids in `exact` (returned from the journal). Returns the largest logprob difference."""
    assert set(got) == set(want)
    worst = 0.0
    for rid, w in want.items():
        g = got[rid]
        assert (g["token_ids"], g["finish_reason"]) == (w["token_ids"], w["finish_reason"]), rid
        np.testing.assert_allclose(g["logprobs"], w["logprobs"], rtol=0, atol=LOGPROB_ATOL,
                                   err_msg=rid)
        if rid in exact:
            assert g["logprobs"] == w["logprobs"], rid
        if w["logprobs"]:
            worst = max(worst, float(np.max(np.abs(np.subtract(g["logprobs"], w["logprobs"])))))
    print(f"largest logprob difference to the uninterrupted run: {worst:.3g}")
    return worst


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    proc, report = cli(tmp, "ref", f"--config.journal_dir={tmp / 'journal'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return report, tmp / "journal"


def test_sigkilled_rollout_resumes_to_the_uninterrupted_responses(uninterrupted, tmp_path):
    want, ref_journal = uninterrupted
    # the run is deterministic (emulated clock): kill it right after the record that follows
    # its first finished response, when other requests are still part-way
    lines = (ref_journal / JOURNAL_FILE).read_bytes().splitlines()
    first_finished = next(i for i, line in enumerate(lines) if b' {"t":"f"' in line)
    kill_at = first_finished + 2
    assert kill_at < len(lines) - 1
    jd = tmp_path / "journal"
    proc, report = cli(tmp_path, "killed", f"--config.journal_dir={jd}",
                       env={KILL_AFTER_ENV: str(kill_at)})
    assert proc.returncode == -9 and report is None, (proc.returncode, proc.stderr[-2000:])
    state = read_journal(jd)
    assert state.records == kill_at and not state.policy("seer").done
    recs = state.policy("seer").requests.values()
    assert any(r.finish_reason is None and r.token_ids for r in recs)  # prefixes to continue
    finished = {r.request_id: r.token_ids for r in recs if r.finish_reason is not None}
    assert finished  # and responses to keep
    proc, report = cli(tmp_path, "resumed", "--resume", str(jd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_responses(responses(report), responses(want), exact=finished)
    rep = report["reports"]["seer"]["report"]
    assert rep["restored_responses"] == len(finished)
    assert rep["reprefill_chunks"] > 0  # the prefixes were re-prefilled (no pool survived)
    assert read_journal(jd).policy("seer").done


@pytest.mark.exhaustive  # torn tails of every record: tests/rollout/test_journal.py
def test_torn_last_record_resumes_from_the_last_whole_one(uninterrupted, tmp_path):
    want, ref_journal = uninterrupted
    data = (ref_journal / JOURNAL_FILE).read_bytes()
    lines = data.splitlines(keepends=True)
    cut = len(lines) * 2 // 3
    jd = tmp_path / "journal"
    jd.mkdir()
    (jd / JOURNAL_FILE).write_bytes(b"".join(lines[:cut]) + lines[cut][:-7])
    assert read_journal(jd).dropped_tail
    proc, report = cli(tmp_path, "resumed", "--resume", str(jd))
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_responses(responses(report), responses(want))


@pytest.mark.parametrize("override, key", [("--config.max_tokens=20", "max_tokens"),
                                           ("--config.model=/nonexistent/model.gguf", "model")])
def test_journal_of_another_config_or_model_is_refused(uninterrupted, tmp_path, override, key):
    _, ref_journal = uninterrupted
    if key == "model":  # another model file: a copy of the same bytes under another name
        import shutil

        from seer_jax.model.hub import resolve_model

        other = tmp_path / "other.gguf"
        shutil.copy(resolve_model("smollm2"), other)
        with open(other, "ab") as f:
            f.write(b"\0")
        override = f"--config.model={other}"
    proc, report = cli(tmp_path, "bad", "--resume", str(ref_journal), override)
    assert proc.returncode == 2 and report is None
    assert "was written by a different rollout" in proc.stderr
    assert f"mismatched: {key}" in proc.stderr or f"; {key}:" in proc.stderr, proc.stderr


def test_finished_journal_returns_its_responses_without_an_engine(uninterrupted, monkeypatch):
    """In process, with model loading and engine construction made to fail."""
    want, ref_journal = uninterrupted
    import seer_jax.model
    import seer_jax.rollout.backends.engine_instance as ei
    from seer_jax.analysis.policies import CATALOG
    from seer_jax.rollout.api import run_rollout

    def no_engine(*a, **k):
        raise AssertionError("an engine or the model weights were loaded")

    monkeypatch.setattr(seer_jax.model, "load", no_engine)
    monkeypatch.setattr(ei, "make_engine_instances", no_engine)
    cfg = load_config_file(os.path.join(ROOT, "configs/rollout/demo.py"), OVERRIDES)
    before = (ref_journal / JOURNAL_FILE).read_bytes()
    run = run_rollout(cfg, catalog=CATALOG, resume=ref_journal)
    got = {r.request_id: {"token_ids": r.token_ids, "finish_reason": r.finish_reason,
                          "logprobs": r.logprobs} for r in run.outputs["seer"].results}
    same_responses(got, responses(want))
    rep = run.outputs["seer"].report.to_json()["report"]
    assert rep == want["reports"]["seer"]["report"]  # the journaled report, as the run wrote it
    assert (ref_journal / JOURNAL_FILE).read_bytes() == before
    with pytest.raises(JournalMismatchError, match="group_size"):
        cfg.group_size = 3
        run_rollout(cfg, catalog=CATALOG, resume=ref_journal)
