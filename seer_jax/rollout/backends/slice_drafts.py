"""Drafts on a multi-host slice: the leader drafts, the other hosts take its drafts.

Every host of a slice runs the same SPMD step, so every host must verify the same drafts. Only
the leader (host 0) keeps a replica of the draft service and drafts; after each proposal it
publishes the step's drafts (after budget and limits: what its engine verifies) in the slice's
`jax.distributed` key-value store, and each other host's speculator reads them there instead of
drafting. Proposals are numbered per engine build, so they pair up exactly: every host's
scheduler is identical and proposes at the same steps.
"""

from __future__ import annotations

import pickle
from typing import Any

from seer_jax.engine.speculation import Speculator

_TIMEOUT_MS = 600_000
_KEEP = 4  # proposals kept in the store (a follower is at most a step behind its leader)


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

    def propose(self, seqs, limits):
        drafts = super().propose(seqs, limits)
        client = _client()
        client.key_value_set_bytes(f"seer/drafts/{self.build}/{self.n}", pickle.dumps(drafts))
        if self.n >= _KEEP:
            client.key_value_delete(f"seer/drafts/{self.build}/{self.n - _KEEP}")
        self.n += 1
        return drafts


class FollowerSpeculator(Speculator):
    """Takes the leader's drafts for each proposal (blocking until they are published)."""

    def __init__(self, budget, build: int):
        super().__init__(_NoService(), budget)
        self.build, self.n = build, 0

    def propose(self, seqs, limits):
        blob = _client().blocking_key_value_get_bytes(f"seer/drafts/{self.build}/{self.n}",
                                                      _TIMEOUT_MS)
        self.n += 1
        drafts = pickle.loads(blob)
        if drafts is not None and len(drafts) != len(seqs):
            raise AssertionError(f"leader proposed for {len(drafts)} sequences, this host has "
                                 f"{len(seqs)}: the slice's schedulers diverged")
        return drafts


def slice_speculator(draft: Any, build: int, host: int):
    """(Speculator, replica or None) of host `host` of a slice, for engine build `build`
    (counted the same on every host)."""
    from seer_jax.drafting.budget import SpeculationBudget

    if host == 0:
        spec, replica = draft.make_speculator()
        return LeaderSpeculator(replica, spec.budget, build), replica
    budget = draft.budget() if draft.budget is not None else SpeculationBudget.from_profile_json(None)
    return FollowerSpeculator(budget, build), None
