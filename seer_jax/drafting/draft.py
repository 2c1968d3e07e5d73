"""Draft token trees and their construction from a suffix automaton context.

A draft for one request is a small token tree hanging off the request's last committed token:

- `tokens[i]`  int32, the draft token of node i;
- `parents[i]` int32, index of node i's parent in this draft, or -1 when the parent is the
  request's last committed token; nodes are in topological order (parents[i] < i);
- `probs[i]`   float32, the estimated probability of the whole root-to-i path (product of the
  frequency ratios count(child) / Σ count(children) along it), non-increasing along a path.

A chain (single path) has parents = [-1, 0, 1, ...]. An empty draft has n = 0.
"""

from __future__ import annotations

import dataclasses
import heapq
import operator

import numpy as np

from seer_jax.drafting.suffix_automaton import SuffixAutomaton

_EMPTY_I32 = np.zeros((0,), np.int32)
_EMPTY_F32 = np.zeros((0,), np.float32)
_EMPTIES: dict[int, Draft] = {}
_rank_key = operator.itemgetter(0, 1)
# a chain's parents and depths: read-only views of these (no arrays built per draft)
_CHAIN_PARENTS = np.arange(-1, 255, dtype=np.int32)
_CHAIN_DEPTHS = np.arange(1, 257, dtype=np.int32)
_CHAIN_PARENTS.flags.writeable = False
_CHAIN_DEPTHS.flags.writeable = False


def _frozen(depths: list[int]) -> np.ndarray:
    d = np.asarray(depths, np.int32)
    d.flags.writeable = False
    return d


def _chain(tokens: list[int], probs: list[float], match_len: int) -> Draft:
    n = len(tokens)
    if n > _CHAIN_DEPTHS.size:
        return Draft.chain(tokens, probs, match_len)
    return Draft(np.asarray(tokens, np.int32), _CHAIN_PARENTS[:n],
                 np.asarray(probs, np.float32), match_len, _CHAIN_DEPTHS[:n])


@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft token tree for one request (see module docstring)."""

    tokens: np.ndarray  # int32 [n]
    parents: np.ndarray  # int32 [n]
    probs: np.ndarray  # float32 [n]
    match_len: int = 0  # length of the context match the draft continues
    # depths(), computed once (read-only; a draft's arrays do not change)
    _depths: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)
    # depth, computed once (-1: not yet)
    _depth: int = dataclasses.field(default=-1, compare=False, repr=False)

    @staticmethod
    def empty(match_len: int = 0) -> Draft:
        d = _EMPTIES.get(match_len)
        if d is None:  # (drafts are immutable: one empty draft per match length is shared)
            d = Draft(_EMPTY_I32, _EMPTY_I32, _EMPTY_F32, match_len, _EMPTY_I32)
            if len(_EMPTIES) < 1024:
                _EMPTIES[match_len] = d
        return d

    @staticmethod
    def chain(tokens, probs=None, match_len: int = 0) -> Draft:
        t = np.asarray(tokens, np.int32).reshape(-1)
        p = np.ones(t.shape, np.float32) if probs is None else np.asarray(probs, np.float32)
        dep = np.arange(1, t.size + 1, dtype=np.int32)
        dep.flags.writeable = False
        return Draft(t, np.arange(-1, t.size - 1, dtype=np.int32), p, match_len, dep)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(-1, len(self) - 1)))

    def depths(self) -> np.ndarray:
        """int32 [n] (read-only): 1 for children of the committed token, parent depth + 1
        below."""
        d = self._depths
        if d is None:
            out: list[int] = []
            for p in self.parents.tolist():
                out.append(1 if p < 0 else out[p] + 1)
            d = np.asarray(out, np.int32)
            d.flags.writeable = False
            object.__setattr__(self, "_depths", d)
        return d

    @property
    def depth(self) -> int:
        d = self._depth
        if d < 0:
            d = max(self.depths().tolist()) if len(self) else 0
            object.__setattr__(self, "_depth", d)
        return d

    def truncate(self, num_nodes: int) -> Draft:
        """The first `num_nodes` nodes (a prefix in topological order is still a tree)."""
        if num_nodes >= len(self):
            return self
        n = max(int(num_nodes), 0)
        dep = None if self._depths is None else self._depths[:n]
        return Draft(self.tokens[:n], self.parents[:n], self.probs[:n], self.match_len, dep)

    def select(self, keep: np.ndarray) -> Draft:
        """The nodes where `keep` (bool [n]) is set, parents re-indexed. Every kept node's parent
        must be kept too (ValueError otherwise)."""
        keep = np.asarray(keep, bool)
        if keep.all():
            return self
        new_index = np.cumsum(keep, dtype=np.int32) - 1
        par = self.parents[keep]
        if np.any(par >= 0) and not keep[par[par >= 0]].all():
            raise ValueError("select: a kept node's parent was dropped")
        new_par = np.where(par >= 0, new_index[np.maximum(par, 0)], -1).astype(np.int32)
        dep = None if self._depths is None else self._depths[keep]  # (ancestors all kept)
        return Draft(self.tokens[keep], new_par, self.probs[keep], self.match_len, dep)

    def path_to(self, node: int) -> list[int]:
        """Tokens from the root to `node` inclusive."""
        out = []
        while node >= 0:
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return out[::-1]

    def accepted_length(self, actual) -> int:
        """Longest root-to-node path whose tokens equal the prefix of `actual` (greedy-style
        verification against a known continuation)."""
        n = len(self)
        if n == 0:
            return 0
        actual = list(actual)
        toks = self.tokens.tolist()
        par = self.parents.tolist()
        best = 0
        matched = {-1: 0}  # node -> depth, for nodes whose path matches `actual`
        for i in range(n):
            d = matched.get(par[i])
            if d is None or d >= len(actual) or toks[i] != actual[d]:
                continue
            matched[i] = d + 1
            if d + 1 > best:
                best = d + 1
        return best

    def validate(self) -> None:
        """Raise ValueError if the arrays do not form a topologically ordered tree."""
        n = len(self)
        if self.parents.shape != (n,) or self.probs.shape != (n,):
            raise ValueError("tokens, parents and probs must have the same length")
        if self.tokens.dtype != np.int32 or self.parents.dtype != np.int32:
            raise ValueError("tokens and parents must be int32")
        idx = np.arange(n)
        if np.any(self.parents >= idx) or np.any(self.parents < -1):
            raise ValueError("parents must satisfy -1 <= parents[i] < i")


def build_draft(
    sam: SuffixAutomaton,
    state: int,
    length: int,
    *,
    max_nodes: int,
    max_depth: int,
    width: int = 1,
    min_prob: float = 0.1,
    context_cap: int | None = None,
    prior: float = 0.0,
) -> Draft:
    """Grow a draft from the context (state, length) of `sam`.

    Chain (width 1): follow the most frequent continuation while the path probability stays
    ≥ min_prob. Tree (width k > 1): best-first expansion by path probability, considering the top
    k continuations of every node, until `max_nodes` nodes. Paths never exceed `max_depth`
    tokens. As a path grows, its context is kept to its last `context_cap` tokens
    (default `sam.count_depth - 1`), so child counts are always exact. A step's probability is
    count(child) / (Σ count(children) + prior).
    """
    if max_nodes <= 0 or max_depth <= 0:
        return Draft.empty(length)
    cap = sam.count_depth - 1 if context_cap is None else min(context_cap, sam.count_depth - 1)
    nxt = sam._next
    count = sam._count
    total = sam._total
    best = sam._best
    clamp = sam.clamp
    if width <= 1:
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        v, k = state, length
        ln, link = sam._len, sam._link
        for _ in range(min(max_nodes, max_depth)):
            tok = best[v]
            if tok < 0:
                break
            x = nxt[v][tok]
            prob *= count[x] / (total[v] + prior)
            if prob < min_prob:
                break
            tokens.append(tok)
            probs.append(prob)
            v, k = x, k + 1
            if k > cap:  # (`SuffixAutomaton.clamp`, inline)
                while v and cap <= ln[link[v]]:
                    v = link[v]
                k = cap
        if not tokens:
            return Draft.empty(length)
        return _chain(tokens, probs, length)

    out_tok: list[int] = []
    out_par: list[int] = []
    out_prob: list[float] = []
    out_dep: list[int] = []
    heap: list = []
    order = 0

    def push_children(parent: int, v: int, k: int, prob: float, depth: int) -> None:
        nonlocal order
        if depth >= max_depth:
            return
        ch = nxt[v]
        if not ch:
            return
        tot = total[v] + prior
        b = best[v]
        if len(ch) == 1:
            ranked = [(count[s], 1, t, s) for t, s in ch.items()]
        else:
            # top `width` by count; the chain's choice (best) first among equals
            ranked = heapq.nlargest(
                width, ((count[s], t == b, t, s) for t, s in ch.items()), key=_rank_key
            )
        for cs, _, t, s in ranked:
            p = prob * cs / tot
            if p < min_prob:
                break
            order += 1
            heapq.heappush(heap, (-p, order, parent, t, s, k + 1, depth + 1))

    push_children(-1, state, length, 1.0, 0)
    while heap and len(out_tok) < max_nodes:
        neg_p, _, parent, t, s, k, depth = heapq.heappop(heap)
        idx = len(out_tok)
        out_tok.append(t)
        out_par.append(parent)
        out_prob.append(-neg_p)
        out_dep.append(depth)
        if k > cap:
            s, k = clamp(s, k, cap)
        push_children(idx, s, k, -neg_p, depth)
    if not out_tok:
        return Draft.empty(length)
    return Draft(np.asarray(out_tok, np.int32), np.asarray(out_par, np.int32),
                 np.asarray(out_prob, np.float32), length, _frozen(out_dep))


def merge_drafts(drafts: list[Draft], max_nodes: int) -> Draft:
    """One token tree holding the paths of several drafts (same committed token): paths with
    equal tokens share nodes, a node's probability is the highest any draft gives it, and the
    `max_nodes` most probable nodes are kept (a parent is never less probable than its child, so
    the kept nodes form a tree). match_len is the longest of the drafts'."""
    drafts = [d for d in drafts if len(d)]
    if not drafts:
        return Draft.empty()
    if len(drafts) == 1:
        return drafts[0].truncate(max_nodes)
    key_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tok: list[int] = []
    par: list[int] = []
    prob: list[float] = []
    depth: list[int] = []
    for d in drafts:
        local = []
        for t, p, pr in zip(d.tokens.tolist(), d.parents.tolist(), d.probs.tolist(), strict=True):
            mp = local[p] if p >= 0 else -1
            node = key_of.get((mp, t))
            if node is None:
                node = key_of[(mp, t)] = len(tok)
                tok.append(t)
                par.append(mp)
                prob.append(pr)
                depth.append(depth[mp] + 1 if mp >= 0 else 1)
            elif pr > prob[node]:
                prob[node] = pr
            local.append(node)
    # keep the most probable nodes (ties: shallower first, so parents come before children)
    order = sorted(range(len(tok)), key=lambda i: (-prob[i], depth[i], i))[:max_nodes]
    order.sort(key=lambda i: (depth[i], -prob[i], i))  # topological: by depth
    new = {old: k for k, old in enumerate(order)}
    return Draft(np.asarray([tok[i] for i in order], np.int32),
                 np.asarray([new[par[i]] if par[i] >= 0 else -1 for i in order], np.int32),
                 np.asarray([prob[i] for i in order], np.float32),
                 max(d.match_len for d in drafts), _frozen([depth[i] for i in order]))
