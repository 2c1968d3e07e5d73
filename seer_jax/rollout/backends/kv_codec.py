"""A typed binary format for KV blobs that leave the process (Mooncake Store, Ray's object store).

Nothing read from a store is unpickled: a blob is a header and raw array bytes, and decoding
builds numpy arrays from the bytes (no code runs). Layout, little-endian:

    magic    6 bytes   b"SEERKV"
    version  u16       FORMAT_VERSION
    length   u32       bytes of the header that follows
    header   JSON      {"type": "KVBlob", "arrays": [{"name", "dtype", "shape"}, ...]}
    payload            each array's bytes (C order), in header order, nothing in between

The format knows nothing of the KV layout: a blob is a set of named arrays, each with its dtype
(from `DTYPES`) and shape. `encode_kv_blob`/`decode_kv_blob` map the engine's `KVBlob` onto it
field by field (token lists as int64 arrays, arrays as they are), so a change of the cache
layout (the shape of the exported K/V) needs no change here. Anything malformed (wrong magic or
version, a header that does not parse or does not add up, an unknown dtype or field, a payload
of the wrong size) raises `KVBlobFormatError` saying what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping

import numpy as np

from seer_jax.errors import SeerError

MAGIC = b"SEERKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<6sHI")  # magic, version, header length
MAX_HEADER_BYTES = 1 << 20
# the dtypes a KV blob may hold (names as numpy / ml_dtypes spell them)
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
          "int32", "int64")


class KVBlobFormatError(SeerError):
    """Bytes that are not a well-formed KV blob; refused before anything is built from them."""


def _dtype(name: str) -> np.dtype:
    if name not in DTYPES:
        raise KVBlobFormatError(f"KV blob array dtype {name!r} is not allowed; allowed: {list(DTYPES)}")
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def encode_arrays(kind: str, arrays: Mapping[str, np.ndarray]) -> bytes:
    """The blob of named arrays (`kind` names what they make up, checked when decoding)."""
    specs, parts = [], []
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        _dtype(arr.dtype.name)  # refuse to write what could not be read back
        specs.append({"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)})
        parts.append(arr.tobytes())
    header = json.dumps({"type": kind, "arrays": specs}, separators=(",", ":")).encode()
    return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header, *parts])


def decode_arrays(data: bytes | bytearray | memoryview, kind: str) -> dict[str, np.ndarray]:
    """The named arrays of a blob of `kind` (read-only views of `data`), or KVBlobFormatError."""
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise KVBlobFormatError(f"KV blob of {len(view)} bytes is shorter than its "
                                f"{_PREFIX.size}-byte prefix; refused")
    magic, version, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise KVBlobFormatError(
            f"not a seer KV blob (starts with {bytes(view[:8])!r}, expected {MAGIC!r}); refused: "
            "pickled or foreign data is never loaded")
    if version != FORMAT_VERSION:
        raise KVBlobFormatError(f"KV blob format version {version} is unknown; allowed: "
                                f"{FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > len(view):
        raise KVBlobFormatError(f"KV blob header length {hlen} does not fit the blob's "
                                f"{len(view)} bytes; refused")
    try:
        header = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KVBlobFormatError(f"KV blob header is not JSON ({e}); refused") from None
    if not isinstance(header, dict) or header.get("type") != kind or not isinstance(
            header.get("arrays"), list):
        raise KVBlobFormatError(f"KV blob header {str(header)[:200]!r} does not describe a "
                                f"{kind}; refused")
    out: dict[str, np.ndarray] = {}
    offset = _PREFIX.size + hlen
    for spec in header["arrays"]:
        if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape"}:
            raise KVBlobFormatError(f"KV blob array entry {str(spec)[:200]!r} is malformed; "
                                    "allowed keys: name, dtype, shape")
        name, shape = spec["name"], spec["shape"]
        if not isinstance(name, str) or name in out:
            raise KVBlobFormatError(f"KV blob array name {name!r} is invalid or repeated")
        if not isinstance(shape, list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise KVBlobFormatError(f"KV blob array {name!r} shape {shape!r} is invalid; "
                                    "allowed: a list of integers >= 0")
        dtype = _dtype(spec["dtype"])
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > len(view):
            raise KVBlobFormatError(f"KV blob array {name!r} ({spec['dtype']} {shape}) needs "
                                    f"{nbytes} bytes at offset {offset}; the blob has "
                                    f"{len(view)}; refused")
        out[name] = np.frombuffer(view[offset:offset + nbytes], dtype=dtype).reshape(shape)
        offset += nbytes
    if offset != len(view):
        raise KVBlobFormatError(f"KV blob has {len(view) - offset} bytes after its last array; "
                                "refused")
    return out


def encode_kv_blob(blob: object) -> bytes:
    """An engine `KVBlob` (a dataclass of token lists and arrays) as bytes."""
    arrays = {}
    for f in dataclasses.fields(blob):
        value = getattr(blob, f.name)
        arrays[f.name] = (np.asarray(value, dtype=np.int64) if isinstance(value, list)
                          else np.asarray(value))
    return encode_arrays(type(blob).__name__, arrays)


def decode_kv_blob(data: bytes | bytearray | memoryview) -> object:
    """The engine `KVBlob` of `encode_kv_blob`'s bytes; KVBlobFormatError for anything else
    (also for a blob whose fields are not exactly the `KVBlob` fields)."""
    from seer_jax.engine.engine import KVBlob

    arrays = decode_arrays(data, KVBlob.__name__)
    fields = {f.name: f for f in dataclasses.fields(KVBlob)}
    if set(arrays) != set(fields):
        raise KVBlobFormatError(f"KV blob fields {sorted(arrays)} are not the KVBlob fields "
                                f"{sorted(fields)}; refused")
    values = {}
    for name, arr in arrays.items():
        if str(fields[name].type).startswith("list"):
            if arr.ndim != 1 or arr.dtype != np.int64:
                raise KVBlobFormatError(f"KV blob field {name!r} must be a 1-d int64 token "
                                        f"list, got {arr.dtype} {list(arr.shape)}; refused")
            values[name] = arr.tolist()
        else:
            values[name] = arr
    return KVBlob(**values)
