"""The drafts of a batch of requests in flat arrays: what the engine plans, lays out, verifies and
commits a speculative step with, without a `Draft` object per request.

`DraftRows` holds R drafts (row i = request i of the decode batch) as one concatenation:
row i's nodes are [starts[i], starts[i + 1]) of `tokens`, `parents` (row-local, -1 = the
request's last committed token), `probs` and `depths`, with its `match_len[i]`. It is a
sequence of `Draft`s (row i as a `Draft` on demand), so callers that want one object per
request still get one; trimming rows (`select`, `truncate`) is a few array operations over
every node of the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from seer_jax.drafting.draft import Draft


class DraftRows(Sequence[Draft]):
    """R drafts in flat arrays (see module docstring)."""

    __slots__ = ("tokens", "parents", "probs", "depths", "starts", "match_len", "_row")

    def __init__(self, tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray,
                 depths: np.ndarray, starts: np.ndarray, match_len: np.ndarray) -> None:
        self.tokens = tokens  # int32 [N]
        self.parents = parents  # int32 [N], row-local
        self.probs = probs  # float32 [N]
        self.depths = depths  # int32 [N]
        self.starts = starts  # int64 [R + 1]
        self.match_len = match_len  # int64 [R]
        self._row: np.ndarray | None = None

    @staticmethod
    def empty(match_len) -> DraftRows:
        """R empty drafts with these match lengths."""
        ml = np.asarray(match_len, np.int64).reshape(-1)
        z = np.zeros(0, np.int32)
        return DraftRows(z, z, np.zeros(0, np.float32), z, np.zeros(ml.size + 1, np.int64), ml)

    @staticmethod
    def from_drafts(drafts: Sequence[Draft]) -> DraftRows:
        if isinstance(drafts, DraftRows):
            return drafts
        n = len(drafts)
        lens = np.fromiter((len(d) for d in drafts), np.int64, n)
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=starts[1:])
        ml = np.fromiter((d.match_len for d in drafts), np.int64, n)
        full = [d for d in drafts if len(d)]
        if not full:
            return DraftRows.empty(ml)
        return DraftRows(np.concatenate([d.tokens for d in full]).astype(np.int32, copy=False),
                         np.concatenate([d.parents for d in full]).astype(np.int32, copy=False),
                         np.concatenate([d.probs for d in full]).astype(np.float32, copy=False),
                         np.concatenate([d.depths() for d in full]), starts, ml)

    @staticmethod
    def from_slots(starts: np.ndarray, n: np.ndarray, match_len: np.ndarray, tokens, parents,
                   probs, depths) -> DraftRows:
        """From arrays where row i's n[i] nodes begin at starts[i] (rows may leave gaps)."""
        R = n.size
        slot_row = np.repeat(np.arange(R), np.diff(starts))
        keep = np.arange(slot_row.size) - starts[slot_row] < n[slot_row]
        new = np.zeros(R + 1, np.int64)
        np.cumsum(n, out=new[1:])
        return DraftRows(tokens[keep], parents[keep], probs[keep], depths[keep], new,
                         match_len.astype(np.int64, copy=False))

    # -- a sequence of drafts --------------------------------------------------------------------

    def __len__(self) -> int:
        return self.match_len.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        s, e = int(self.starts[i]), int(self.starts[i + 1])
        if s == e:
            return Draft.empty(int(self.match_len[i]))
        return Draft(self.tokens[s:e], self.parents[s:e], self.probs[s:e],
                     int(self.match_len[i]), self.depths[s:e])

    def __iter__(self) -> Iterator[Draft]:
        return (self[i] for i in range(len(self)))

    # -- batch views -----------------------------------------------------------------------------

    @property
    def lens(self) -> np.ndarray:
        """int64 [R]: nodes of each row."""
        return np.diff(self.starts)

    @property
    def num_nodes(self) -> int:
        return int(self.starts[-1])

    @property
    def row(self) -> np.ndarray:
        """intp [N]: the row of each node."""
        if self._row is None:
            self._row = np.repeat(np.arange(len(self)), self.lens)
        return self._row

    def node_index(self) -> np.ndarray:
        """int64 [N]: each node's index within its row."""
        return np.arange(self.num_nodes) - self.starts[self.row]

    def row_depths(self) -> np.ndarray:
        """int64 [R]: each row's depth (0: empty)."""
        out = np.zeros(len(self), np.int64)
        if self.num_nodes:
            np.maximum.at(out, self.row, self.depths)
        return out

    def select(self, keep: np.ndarray) -> DraftRows:
        """The nodes where keep (bool [N]) is set, parents re-indexed within their rows. Every
        kept node's parent must be kept too."""
        if keep.all():
            return self
        row = self.row
        new_global = np.cumsum(keep) - 1
        kept_row = row[keep]
        counts = np.bincount(kept_row, minlength=len(self))
        starts = np.zeros(len(self) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        par = self.parents[keep]
        parent_global = self.starts[kept_row] + np.maximum(par, 0)
        new_par = np.where(par >= 0, new_global[parent_global] - starts[kept_row], -1)
        return DraftRows(self.tokens[keep], new_par.astype(np.int32), self.probs[keep],
                         self.depths[keep], starts, self.match_len)

    def truncate(self, num_nodes: np.ndarray) -> DraftRows:
        """Each row's first num_nodes[i] nodes (a prefix in topological order is a tree)."""
        num_nodes = np.asarray(num_nodes)
        if (num_nodes >= self.lens).all():
            return self
        return self.select(self.node_index() < num_nodes[self.row])
