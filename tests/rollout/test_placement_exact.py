"""choose_instance equals the lexicographic-minimum rule it implements (placement.py), on random
slot states, balanced and not."""

from __future__ import annotations

import numpy as np

from seer_jax.rollout.core.placement import InstanceSlot, choose_instance


def _reference(slots, pages, resident, threshold, kv_admission=True):
    alive = [s for s in slots if s.alive]
    if not alive:
        return None
    flights = [s.in_flight for s in alive]
    balanced = max(flights) - min(flights) <= threshold
    cands = [s for s in alive if s.fits(pages(s), kv_admission)]
    if not cands:
        return None
    if balanced:
        return min(cands, key=lambda s: (-resident(s), s.in_flight, s.instance_id))
    return min(cands, key=lambda s: (s.in_flight, -resident(s), s.instance_id))


def test_choose_instance_matches_the_reference_rule():
    rng = np.random.default_rng(0)
    for trial in range(600):
        n = int(rng.integers(1, 12))
        slots = [InstanceSlot(i, total_pages=64, page_size=16,
                              in_flight=int(rng.integers(0, 5)),
                              reserved_pages=int(rng.integers(0, 64)),
                              alive=bool(rng.random() > 0.1)) for i in range(n)]
        res = {i: int(rng.choice([0, 0, 100, 300])) for i in range(n)}
        need = int(rng.integers(1, 40))
        threshold = int(rng.integers(0, 4))
        args = (lambda s, need=need: need, lambda s, res=res: res[s.instance_id], threshold)
        assert choose_instance(slots, *args) is _reference(slots, *args), trial
        assert choose_instance(slots, *args, False) is _reference(slots, *args, False), trial
