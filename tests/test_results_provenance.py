"""Recorded results name commits of this repository: every `commit` in a run block of a JSON under
benchmarks/results/ and every commit hash cited in docs/results.md and README.md is in the git
history (an ancestor of HEAD), so the code that produced a number can be checked out."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results"
DOCS = ("docs/results.md", "README.md")
# a hex word of 7-40 characters with a digit and a letter; not a sha256 digest ("sha256 ...")
HASH = re.compile(r"(?<![\w/.-])(?<!sha256 )(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


def _in_checkout() -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"
    except (OSError, subprocess.SubprocessError):
        return False


pytestmark = pytest.mark.skipif(not _in_checkout(), reason="not a git checkout")


def _in_history(sha: str) -> bool:
    if _git("cat-file", "-e", f"{sha}^{{commit}}").returncode != 0:
        return False
    return _git("merge-base", "--is-ancestor", sha, "HEAD").returncode == 0


def run_blocks(obj, where: str = ""):
    """(path, block) for every dict in `obj` that records a run: it has a `commit` and a
    `command`."""
    if isinstance(obj, dict):
        if "commit" in obj and "command" in obj:
            yield where or "/", obj
        for k, v in obj.items():
            yield from run_blocks(v, f"{where}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from run_blocks(v, f"{where}[{i}]")


def cited_hashes(text: str) -> list[tuple[int, str]]:
    """(line, hash) for every commit-like hex word in `text`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in HASH.finditer(text)]


def test_hash_pattern():
    text = "at commit 5a6db20 (`a41522f`), sha256 f5b10bb90eecd4ec..., not deadbeef or 1234567"
    assert [h for _, h in cited_hashes(text)] == ["5a6db20", "a41522f"]


def test_results_json_commits_are_in_history():
    bad = []
    for path in sorted(RESULTS.rglob("*.json")):
        for where, block in run_blocks(json.loads(path.read_text())):
            sha = block["commit"]
            if not (isinstance(sha, str) and sha and _in_history(sha)):
                bad.append(f"{path.relative_to(ROOT)} {where}: commit {sha!r}")
    assert not bad, "run blocks naming commits outside the history:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS)
def test_cited_commits_are_in_history(doc):
    text = (ROOT / doc).read_text()
    bad = [f"{doc}:{line}: {sha}" for line, sha in cited_hashes(text) if not _in_history(sha)]
    assert not bad, "commits cited but not in the history:\n" + "\n".join(bad)
