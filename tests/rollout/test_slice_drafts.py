"""The drafts a multi-host slice's leader publishes to its followers cross processes as typed
arrays: they round-trip exactly, and a pickle or malformed proposal is refused without running
anything."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from seer_jax.drafting.draft import Draft
from seer_jax.rollout.backends.kv_codec import KVBlobFormatError, encode_arrays
from seer_jax.rollout.backends.slice_drafts import decode_drafts, encode_drafts


def _drafts():
    tree = Draft(np.asarray([5, 6, 7, 8], np.int32), np.asarray([-1, 0, 0, 2], np.int32),
                 np.asarray([0.9, 0.5, 0.25, 0.125], np.float32), match_len=3)
    return [Draft.chain([11, 12, 13], [0.5, 0.25, 0.125], match_len=2), Draft.empty(4), tree]


def test_a_proposal_round_trips_exactly():
    want = _drafts()
    got = decode_drafts(encode_drafts(want), len(want))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for field in ("tokens", "parents", "probs"):
            np.testing.assert_array_equal(getattr(g, field), getattr(w, field))
            assert getattr(g, field).dtype == getattr(w, field).dtype
        assert g.match_len == w.match_len
    assert decode_drafts(encode_drafts(None), 3) is None  # speculation off this step
    assert decode_drafts(encode_drafts([]), 0) == []


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /nonexistent-seer-test",))


def test_a_pickle_is_refused_and_never_loaded(monkeypatch):
    ran = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: ran.append(a))
    with pytest.raises(KVBlobFormatError, match="never loaded"):
        decode_drafts(pickle.dumps(_Boom()), 1)
    assert ran == []


@pytest.mark.parametrize(("arrays", "match"), [
    ({"enabled": [1], "sizes": [2], "match_len": [0], "tokens": [1, 2], "parents": [-1, 0],
      "probs": [1.0]}, "do not add up"),
    ({"enabled": [1], "sizes": [2], "match_len": [0], "tokens": [1, 2], "parents": [-1, 5],
      "probs": [1.0, 1.0]}, "not a tree"),
    ({"enabled": [1], "sizes": [-1, 3], "match_len": [0, 0], "tokens": [1, 2],
      "parents": [-1, 0], "probs": [1.0, 1.0]}, "do not add up"),
])
def test_malformed_proposals_are_refused(arrays, match):
    dtypes = {"enabled": np.uint8, "sizes": np.int64, "match_len": np.int64, "tokens": np.int32,
              "parents": np.int32, "probs": np.float32}
    blob = encode_arrays("SliceDrafts", {k: np.asarray(v, dtypes[k]) for k, v in arrays.items()})
    with pytest.raises(KVBlobFormatError, match=match):
        decode_drafts(blob, len(arrays["sizes"]))


def test_a_proposal_for_another_batch_size_is_refused():
    with pytest.raises(KVBlobFormatError, match=r"for 3 sequences .*\(this host has 2\)"):
        decode_drafts(encode_drafts(_drafts()), 2)
    with pytest.raises(KVBlobFormatError, match="expected 1-d"):
        decode_drafts(encode_arrays("SliceDrafts", {"tokens": np.zeros(2, np.int32)}), 0)
