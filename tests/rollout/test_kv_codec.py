"""The typed KV blob format: round trips of any named arrays, and refusal of everything else
(pickles, truncated or inconsistent blobs) before anything is built or run."""

from __future__ import annotations

import json
import pickle
import struct

import ml_dtypes
import numpy as np
import pytest

from seer_jax.engine.engine import KVBlob
from seer_jax.rollout.backends.kv_codec import (
    KVBlobFormatError,
    decode_arrays,
    decode_kv_blob,
    encode_arrays,
    encode_kv_blob,
)


def _blob(dtype=np.float32, shape=(2, 3, 5, 4)):  # [layers, kv heads, tokens, head dim]
    rng = np.random.default_rng(0)
    return KVBlob([1, 2, 3], [4, 5], rng.normal(size=shape).astype(dtype),
                  rng.normal(size=shape).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
def test_kv_blob_round_trips_exactly(dtype):
    blob = _blob(dtype)
    back = decode_kv_blob(encode_kv_blob(blob))
    assert back.prompt_ids == [1, 2, 3] and back.output_ids == [4, 5]
    for a, b in ((blob.k, back.k), (blob.v, back.v)):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_any_named_arrays_and_shapes_round_trip():
    """The format knows no KV layout: any names, ranks and empty arrays."""
    arrays = {"k": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "scales": np.ones(0),
              "pages": np.arange(6, dtype=np.int32).reshape(6, 1, 1, 1)}
    back = decode_arrays(encode_arrays("Anything", arrays), "Anything")
    assert list(back) == list(arrays)
    for name, arr in arrays.items():
        assert back[name].dtype == arr.dtype and np.array_equal(back[name], arr)


class _Payload:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['MARK']).touch()",))


def test_a_pickle_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    mark = tmp_path / "ran"
    monkeypatch.setenv("MARK", str(mark))
    data = pickle.dumps(_Payload(), protocol=5)
    with pytest.raises(KVBlobFormatError, match="not a seer KV blob .* pickled or foreign data"):
        decode_kv_blob(data)
    assert not mark.exists()
    pickle.loads(data)  # the payload is live: unpickling it would have run it
    assert mark.exists()


def _with_header(header: dict, payload: bytes = b"", version: int = 1) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<6sHI", b"SEERKV", version, len(raw)) + raw + payload


GOOD = encode_kv_blob(_blob())
ARRAY = {"name": "k", "dtype": "float32", "shape": [2]}


@pytest.mark.parametrize("data, match", [
    (b"SEER", "shorter than its"),
    (GOOD[:-1], "needs 480 bytes"),
    (GOOD + b"\0", "1 bytes after its last array"),
    (_with_header({"type": "KVBlob", "arrays": []}, version=2), "format version 2 is unknown"),
    (struct.pack("<6sHI", b"SEERKV", 1, 10_000) + b"{}", "header length 10000 does not fit"),
    (struct.pack("<6sHI", b"SEERKV", 1, 3) + b"{x}", "header is not JSON"),
    (_with_header({"type": "Other", "arrays": []}), "does not describe a KVBlob"),
    (_with_header({"type": "KVBlob", "arrays": [dict(ARRAY, dtype="object")]}, b"\0" * 8),
     "dtype 'object' is not allowed"),
    (_with_header({"type": "KVBlob", "arrays": [dict(ARRAY, shape=[-1])]}), "shape \\[-1\\] is invalid"),
    (_with_header({"type": "KVBlob", "arrays": [dict(ARRAY, code="x")]}), "entry .* is malformed"),
    (_with_header({"type": "KVBlob", "arrays": [ARRAY, ARRAY]}, b"\0" * 16), "invalid or repeated"),
    (_with_header({"type": "KVBlob", "arrays": [ARRAY]}, b"\0" * 8), "are not the KVBlob fields"),
])
def test_malformed_blobs_are_refused_with_what_is_wrong(data, match):
    with pytest.raises(KVBlobFormatError, match=match):
        decode_kv_blob(data)


def test_token_fields_must_be_int64_token_lists():
    data = encode_arrays("KVBlob", {"prompt_ids": np.ones((2, 2), np.int64),
                                    "output_ids": np.ones(1, np.int64),
                                    "k": np.ones(1, np.float32), "v": np.ones(1, np.float32)})
    with pytest.raises(KVBlobFormatError, match="'prompt_ids' must be a 1-d int64 token list"):
        decode_kv_blob(data)
