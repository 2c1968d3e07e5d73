"""Drafts on a multi-host slice: the leader drafts, the other hosts take its drafts.

Every host of a slice runs the same SPMD step, so every host must verify the same drafts. Only
the leader (host 0) keeps a replica of the draft service and drafts; after each proposal it
publishes the step's drafts (after budget and limits: what its engine verifies) in the slice's
`jax.distributed` key-value store, and each other host's speculator reads them there instead of
drafting. Proposals are numbered per engine build, so they pair up exactly: every host's
scheduler is identical and proposes at the same steps. A proposal crosses processes in the typed
binary format of `kv_codec` (arrays of token ids, parents and probabilities; never a pickle:
the key-value store has no authentication).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from seer_jax.drafting.draft import Draft
from seer_jax.engine.speculation import Speculator
from seer_jax.rollout.backends.kv_codec import KVBlobFormatError, decode_arrays, encode_arrays

_TIMEOUT_MS = 600_000
_KEEP = 4  # proposals kept in the store (a follower is at most a step behind its leader)


_KIND = "SliceDrafts"


def encode_drafts(drafts: list[Draft] | None) -> bytes:
    """A proposal (one `Draft` per sequence, or None: speculation off this step) as bytes."""
    enabled = drafts is not None
    drafts = drafts or []

    def cat(xs, dt):
        return np.concatenate([np.asarray(x, dt) for x in xs]) if xs else np.zeros((0,), dt)

    return encode_arrays(_KIND, {
        "enabled": np.asarray([int(enabled)], np.uint8),
        "sizes": np.asarray([len(d) for d in drafts], np.int64),
        "match_len": np.asarray([d.match_len for d in drafts], np.int64),
        "tokens": cat([d.tokens for d in drafts], np.int32),
        "parents": cat([d.parents for d in drafts], np.int32),
        "probs": cat([d.probs for d in drafts], np.float32)})


def decode_drafts(data: bytes, num_seqs: int) -> list[Draft] | None:
    """The proposal of `encode_drafts`' bytes (for `num_seqs` sequences); KVBlobFormatError for
    anything else."""
    a = decode_arrays(data, _KIND)
    want = {"enabled": np.uint8, "sizes": np.int64, "match_len": np.int64, "tokens": np.int32,
            "parents": np.int32, "probs": np.float32}
    if set(a) != set(want) or any(a[k].dtype != dt or a[k].ndim != 1 for k, dt in want.items()):
        raise KVBlobFormatError(f"slice drafts hold {sorted((k, str(v.dtype)) for k, v in a.items())}"
                                f"; expected 1-d {sorted((k, np.dtype(v).name) for k, v in want.items())}")
    if a["enabled"].tolist() == [0] and not len(a["sizes"]):
        return None
    sizes = a["sizes"]
    n = int(sizes.sum()) if len(sizes) else 0
    if (a["enabled"].tolist() != [1] or len(sizes) != num_seqs or len(a["match_len"]) != num_seqs
            or (sizes < 0).any() or not len(a["tokens"]) == len(a["parents"]) == len(a["probs"]) == n):
        raise KVBlobFormatError(f"slice drafts for {len(sizes)} sequences with sizes "
                                f"{sizes.tolist()[:16]} do not add up (this host has {num_seqs})")
    out, at = [], 0
    for size, match in zip(sizes.tolist(), a["match_len"].tolist(), strict=True):
        parents = a["parents"][at:at + size]
        if (parents < -1).any() or (parents >= np.arange(size)).any():
            raise KVBlobFormatError(f"slice draft parents {parents.tolist()[:16]} are not a tree")
        out.append(Draft(a["tokens"][at:at + size].copy(), parents.copy(),
                         a["probs"][at:at + size].copy(), int(match)))
        at += size
    return out


def _client():
    from jax._src import distributed

    return distributed.global_state.client


class _NoService:
    """The follower's draft service: nothing to append to, no drafts of its own."""

    def append(self, group_id, request_id, token_ids) -> int:
        return 0

    def speculate(self, queries):
        raise AssertionError("a follower host takes its leader's drafts")


class LeaderSpeculator(Speculator):
    """Drafts from the leader's replica and publishes every proposal to the slice."""

    def __init__(self, service, budget, build: int):
        super().__init__(service, budget)
        self.build, self.n = build, 0

    def wants_drafts(self, num_seqs: int) -> bool:
        return True  # every host plans alike: no overlap that hangs on a host's own budget

    def propose(self, seqs, limits):
        drafts = super().propose(seqs, limits)
        client = _client()
        client.key_value_set_bytes(f"seer/drafts/{self.build}/{self.n}", encode_drafts(drafts))
        if self.n >= _KEEP:
            client.key_value_delete(f"seer/drafts/{self.build}/{self.n - _KEEP}")
        self.n += 1
        return drafts


class FollowerSpeculator(Speculator):
    """Takes the leader's drafts for each proposal (blocking until they are published)."""

    def __init__(self, budget, build: int):
        super().__init__(_NoService(), budget)
        self.build, self.n = build, 0

    def wants_drafts(self, num_seqs: int) -> bool:
        return True  # as the leader: each step is committed before the next is planned

    def propose(self, seqs, limits):
        blob = _client().blocking_key_value_get_bytes(f"seer/drafts/{self.build}/{self.n}",
                                                      _TIMEOUT_MS)
        self.n += 1
        try:
            return decode_drafts(blob, len(seqs))
        except KVBlobFormatError as e:
            raise AssertionError(f"the leader's drafts do not fit this host's {len(seqs)} "
                                 f"sequences ({e}): the slice's schedulers diverged") from None


def slice_speculator(draft: Any, build: int, host: int):
    """(Speculator, replica or None) of host `host` of a slice, for engine build `build`
    (counted the same on every host)."""
    from seer_jax.drafting.budget import SpeculationBudget

    if host == 0:
        spec, replica = draft.make_speculator()
        return LeaderSpeculator(replica, spec.budget, build), replica
    budget = draft.budget() if draft.budget is not None else SpeculationBudget.from_profile_json(None)
    return FollowerSpeculator(budget, build), None
