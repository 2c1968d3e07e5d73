"""Placement: which instance runs a request's next chunk.

Rule (Seer paper §4.2):
- *balanced* (max - min in-flight chunks across live instances <= `balance_threshold`): prefer
  the instance holding the most of the request's context (its own KV pages, else its group's
  prompt): `resident_tokens`; ties -> fewer in flight -> lower id;
- *unbalanced* (spread > threshold): the instance with the fewest chunks in flight; ties -> more
  resident tokens -> lower id.
Only instances with room are candidates (`InstanceSlot.fits`): under KV-budget admission the
pages reserved for chunks already there plus this chunk's worst case (context + chunk budget)
must fit in the instance's KV pages, and the optional in-flight cap must not be reached.
Backfill without starvation: when a request fits nowhere, the controller blocks its pages on one
live instance (`blocked_pages`; the one with the most free budget when it was first held, then the
same one every dispatch round until it runs), so lower-priority requests fill other holes but
cannot keep a large request (a late chunk with a long context) out forever. A target re-chosen
each round would follow the free budget from instance to instance while smaller requests took the
room freed on the last one (on the Moonlight preset the longest responses waited ~130 s between
chunks that way).
When the chosen instance lacks the request's KV the chunk carries its pool handle, so the
instance pulls the KV from the pool (re-prefill only if the pool evicted it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class InstanceSlot:
    """The controller's view of one instance for placement."""

    instance_id: int
    total_pages: int
    page_size: int
    in_flight: int = 0
    reserved_pages: int = 0
    alive: bool = True
    max_in_flight: int | None = None
    blocked_pages: int = 0  # held back this dispatch round for a higher-priority request

    @property
    def free_pages(self) -> int:
        return self.total_pages - self.reserved_pages - self.blocked_pages

    def fits(self, pages: int, kv_admission: bool = True) -> bool:
        if not self.alive:
            return False
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            return False
        # free_pages, inline: placement asks every slot for every chunk
        return not kv_admission or pages <= (self.total_pages - self.reserved_pages
                                             - self.blocked_pages)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)


def choose_instance(
    slots: Sequence[InstanceSlot],
    pages_needed: Callable[[InstanceSlot], int],
    resident_tokens: Callable[[InstanceSlot], int],
    balance_threshold: int,
    kv_admission: bool = True,
) -> InstanceSlot | None:
    """The slot to run a chunk on, or None when no live instance has room for it now."""
    alive = [s for s in slots if s.alive]
    if not alive:
        return None
    flights = [s.in_flight for s in alive]
    balanced = max(flights) - min(flights) <= balance_threshold
    candidates = [s for s in alive if s.fits(pages_needed(s), kv_admission)]
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    # The lexicographic minimum of the keys below, in passes: the first key's best, then the
    # next key among those only (resident_tokens is asked only where it can decide).
    if balanced:  # (-resident_tokens, in_flight, instance_id)
        res = [resident_tokens(s) for s in candidates]
        most = max(res)
        best = [s for s, r in zip(candidates, res, strict=True) if r == most]
        return min(best, key=lambda s: (s.in_flight, s.instance_id))
    # (in_flight, -resident_tokens, instance_id)
    fewest = min(s.in_flight for s in candidates)
    best = [s for s in candidates if s.in_flight == fewest]
    if len(best) == 1:
        return best[0]
    res = [resident_tokens(s) for s in best]
    most = max(res)
    return min((s for s, r in zip(best, res, strict=True) if r == most),
               key=lambda s: s.instance_id)


def least_loaded_order(slots: Sequence[InstanceSlot]) -> list[InstanceSlot]:
    """Live slots ordered by in-flight chunks, then id (used to re-pin a lost instance's groups)."""
    return sorted((s for s in slots if s.alive), key=lambda s: (s.in_flight, s.instance_id))
