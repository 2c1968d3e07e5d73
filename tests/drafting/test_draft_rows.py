"""`DraftRows` (a batch's drafts in flat arrays) trims rows exactly as `Draft` trims one draft."""

from __future__ import annotations

import numpy as np

from seer_jax.drafting.draft import Draft
from seer_jax.drafting.draft_rows import DraftRows


def random_tree(rng, n: int, match_len: int) -> Draft:
    parents = [-1 if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i)) for i in range(n)]
    if not n:
        return Draft.empty(match_len)
    probs = np.sort(rng.random(n).astype(np.float32))[::-1].copy()
    return Draft(rng.integers(0, 50, n).astype(np.int32), np.asarray(parents, np.int32), probs,
                 match_len)


def same(a: Draft, b: Draft) -> bool:
    return (a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            and a.probs.tobytes() == b.probs.tobytes() and a.depths().tolist() == b.depths().tolist()
            and a.match_len == b.match_len)


def test_rows_select_and_truncate_as_each_draft_does():
    rng = np.random.default_rng(0)
    for _ in range(50):
        drafts = [random_tree(rng, int(rng.integers(0, 7)), int(rng.integers(0, 9)))
                  for _ in range(int(rng.integers(1, 9)))]
        rows = DraftRows.from_drafts(drafts)
        assert len(rows) == len(drafts) and all(same(a, b) for a, b in zip(drafts, rows, strict=True))
        assert rows.row_depths().tolist() == [d.depth for d in drafts]
        cut = rng.integers(0, 7, len(drafts))
        got = rows.truncate(cut)
        assert all(same(d.truncate(int(k)), g) for d, k, g in zip(drafts, cut, got, strict=True))
        lim = rng.integers(0, 4, len(drafts))
        got = rows.select(rows.depths <= lim[rows.row])
        want = [d.select(d.depths() <= k) if len(d) else d for d, k in zip(drafts, lim, strict=True)]
        assert all(same(w, g) for w, g in zip(want, got, strict=True))


def test_rows_from_slots_drop_the_gaps():
    starts = np.array([0, 4, 4, 9])
    n = np.array([2, 0, 3])
    tok = np.arange(9, dtype=np.int32)
    rows = DraftRows.from_slots(starts, n, np.array([1, 2, 3]), tok, np.array(
        [-1, 0, 9, 9, -1, 0, 1, 9, 9], np.int32), np.ones(9, np.float32),
        np.array([1, 2, 0, 0, 1, 2, 3, 0, 0], np.int32))
    assert rows.starts.tolist() == [0, 2, 2, 5] and rows.tokens.tolist() == [0, 1, 4, 5, 6]
    assert [len(d) for d in rows] == [2, 0, 3] and rows[1].match_len == 2
