"""Resuming a journaled rollout of real SmolLM2 engines: a sampled (T=1) `seer-jax rollout`
process SIGKILLed in the middle (deterministically, after N journal records:
tests/rollout/journal_kill.py) and resumed returns the responses of an uninterrupted run; a torn
last record, another config, a model file whose bytes changed, and a finished journal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from seer_jax.config_files import load_config_file
from seer_jax.model.hub import resolve_model
from seer_jax.rollout.core.journal import (
    FORMAT,
    JOURNAL_FILE,
    JournalMismatchError,
    encode,
    read_journal,
)
from seer_jax.rollout.resume import file_identity
from tests.subprocess_env import xla_flags_without_device_count

# real engines in subprocesses; one worker runs the module, so its uninterrupted run runs once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# sampled (T=1: a resumed request's later tokens must draw the same samples; greedy is the
# easier case), small: 3 prompts x 2 samples x 24 tokens in chunks of 8 (so requests end chunks
# unfinished and the journal holds prefixes), one policy
OVERRIDES = ["--config.num_prompts=3", "--config.group_size=2", "--config.max_tokens=24",
             "--config.controller.chunk_size=8", "--config.policies=seer",
             "--config.temperature=1.0"]
# logprobs of a resumed request's later tokens come from a forward pass over a re-prefilled
# context instead of the incremental decode that made them in the uninterrupted run: the same
# math in a different order of float32 operations
LOGPROB_ATOL = 1e-4


def cli(tmp_path, name, *args, kill_after=None):
    """`seer-jax rollout` of the demo config; kill_after=N: SIGKILLed after N journal records."""
    out = tmp_path / f"{name}.json"
    launch = (["-m", "seer_jax.cli"] if kill_after is None else
              [os.path.join(ROOT, "tests/rollout/journal_kill.py"), str(kill_after)])
    proc = subprocess.run(
        [sys.executable, *launch, "rollout", "--config",
         os.path.join(ROOT, "configs/rollout/demo.py"), "--no-progress", "--json", str(out),
         *OVERRIDES, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "XLA_FLAGS": xla_flags_without_device_count(), "PYTHONPATH": ROOT})
    # (the CLI asks for the CPU devices it needs)
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
    proc, report = cli(tmp_path, "killed", f"--config.journal_dir={jd}", kill_after=kill_at)
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


def test_journal_of_another_config_is_refused(uninterrupted, tmp_path):
    _, ref_journal = uninterrupted
    proc, report = cli(tmp_path, "bad", "--resume", str(ref_journal), "--config.max_tokens=20")
    assert proc.returncode == 2 and report is None
    assert "was written by a different rollout" in proc.stderr
    assert "mismatched: max_tokens: journal 24, now 20" in proc.stderr, proc.stderr


def test_journal_of_a_model_file_whose_bytes_changed_is_refused(uninterrupted, tmp_path):
    """Same path, same size, one byte of the weights changed: the resume is refused, as the
    fingerprint hashes the model's bytes."""
    _, ref_journal = uninterrupted
    model = tmp_path / "model.gguf"
    shutil.copy(resolve_model("smollm2"), model)
    # the reference journal as this copy of the model would have written it
    fingerprint = {**read_journal(ref_journal).fingerprint, "model": str(model),
                   "model_files": file_identity(model)}
    lines = (ref_journal / JOURNAL_FILE).read_bytes().splitlines(keepends=True)
    jd = tmp_path / "journal"
    jd.mkdir()
    (jd / JOURNAL_FILE).write_bytes(
        encode({"t": "h", "format": FORMAT, "fingerprint": fingerprint}) + b"".join(lines[1:]))
    size = model.stat().st_size
    with open(model, "r+b") as f:  # a byte in the middle of the file, far from either end
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x55]))
    assert model.stat().st_size == size
    proc, report = cli(tmp_path, "bad", "--resume", str(jd), f"--config.model={model}")
    assert proc.returncode == 2 and report is None
    assert "was written by a different rollout" in proc.stderr
    assert "mismatched: model_files: journal" in proc.stderr, proc.stderr
    assert "; " not in proc.stderr.split("mismatched: ")[1]  # the only key that differs


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
