"""An online generalized suffix automaton over several token sequences, with occurrence counts.

This is the index behind the group draft context. It holds every substring of a set of sequences
(the group's prompt and each response continuing it), is extended one token at a time on any
sequence in any interleaving, and answers "which tokens followed this context, how often".

Structure (standard suffix automaton, generalized to several strings, built online):
- state v holds a set of substrings with identical end positions; `len[v]` is the longest,
  `link[v]` the state of the longest proper suffix outside v; `next[v]` maps token -> state.
- ≤ 2N states and ≤ 3N transitions for N appended tokens: memory linear in tokens.
- appending one token costs amortised O(1) structure updates.

Occurrence counts with bounded depth. `count[v]` = number of occurrences (end positions) of the
strings of v. Keeping every count exact would cost O(length of the suffix-link chain) per token,
unbounded on repetitive text; we keep them exact only for *short* states, those holding a string
of length ≤ `count_depth` (i.e. `len[link[v]] < count_depth`). A new end position increments the
short states on its suffix-link chain: at most `count_depth + 1` of them, usually a handful.
Each sequence keeps a pointer (state, length) to its suffix of length min(count_depth, L), which
is where that walk starts; pointers are revalidated lazily (a clone only splits a state, so a stale
pointer is fixed by following suffix links).

Continuation statistics. For every state holding a string of length ≤ count_depth - 1 (the
longest context a query uses) we also keep `total[v]` = Σ_c count(child c), the number of
occurrences that have a continuation, and `best[v]` = the token of the most frequent child
(ties: the first to reach the maximum). Both change only for the states on the *previous*
position's suffix-link chain when a token is appended (the contexts the new token continues), so
they cost one more bounded walk per token and make the most frequent continuation and its ratio
O(1) to read, however many distinct tokens followed a short context.

Sequences can fork: a response starts at the end of the prompt (`add_sequence(fork_from=prompt)`)
so that it shares the prompt's positions (counted once) and its first tokens match across the
prompt/response boundary.
"""

from __future__ import annotations

from collections.abc import Iterable

from seer_jax.errors import InputError


class SuffixAutomaton:
    """Generalized suffix automaton over sequences with bounded-depth occurrence counts.

    count_depth: counts are exact for every string of length ≤ count_depth (queries about longer
      contexts must first be shortened to that length, see `clamp`).
    """

    __slots__ = ("count_depth", "_len", "_link", "_next", "_count", "_total", "_best", "_last",
                 "_wstate", "_wlen", "_seq_len", "num_tokens")

    def __init__(self, count_depth: int = 65) -> None:
        if count_depth < 1:
            raise InputError(f"count_depth must be >= 1, got {count_depth}")
        self.count_depth = int(count_depth)
        # State 0 is the root (empty string); its link is -1.
        self._len: list[int] = [0]
        self._link: list[int] = [-1]
        self._next: list[dict[int, int]] = [{}]
        self._count: list[int] = [0]
        self._total: list[int] = [0]
        self._best: list[int] = [-1]
        # Per sequence: state of the whole sequence, pointer to its count_depth-suffix, length.
        self._last: list[int] = []
        self._wstate: list[int] = []
        self._wlen: list[int] = []
        self._seq_len: list[int] = []
        self.num_tokens = 0  # positions appended (shared fork prefixes counted once)

    # -- sizes -----------------------------------------------------------------------------------

    @property
    def num_states(self) -> int:
        return len(self._len)

    @property
    def num_sequences(self) -> int:
        return len(self._last)

    def num_transitions(self) -> int:
        return sum(len(d) for d in self._next)

    def sequence_length(self, seq: int) -> int:
        return self._seq_len[seq]

    # -- building --------------------------------------------------------------------------------

    def add_sequence(self, fork_from: int | None = None) -> int:
        """Start a new sequence (empty, or continuing the current end of `fork_from`); its id."""
        if fork_from is None:
            self._last.append(0)
            self._wstate.append(0)
            self._wlen.append(0)
            self._seq_len.append(0)
        else:
            if not 0 <= fork_from < len(self._last):
                raise InputError(f"fork_from={fork_from} is not a sequence id")
            self._last.append(self._last[fork_from])
            self._wstate.append(self._wstate[fork_from])
            self._wlen.append(self._wlen[fork_from])
            self._seq_len.append(self._seq_len[fork_from])
        return len(self._last) - 1

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        """Append tokens to sequence `seq`."""
        for t in tokens:
            self._extend1(seq, int(t))

    def _new_state(self, length: int, link: int, nxt: dict[int, int], count: int,
                   total: int = 0, best: int = -1) -> int:
        self._len.append(length)
        self._link.append(link)
        self._next.append(nxt)
        self._count.append(count)
        self._total.append(total)
        self._best.append(best)
        return len(self._len) - 1

    def _clone(self, q: int, length: int) -> int:
        """A new state with q's transitions and statistics (same end positions so far)."""
        return self._new_state(length, self._link[q], dict(self._next[q]), self._count[q],
                               self._total[q], self._best[q])

    def _extend1(self, seq: int, c: int) -> None:
        ln = self._len
        link = self._link
        nxt = self._next
        last = self._last[seq]
        q = nxt[last].get(c)
        if q is not None:
            # The extended string already occurs (another sequence wrote it): reuse or split.
            if ln[q] == ln[last] + 1:
                cur = q
            else:
                cur = self._clone(q, ln[last] + 1)
                p = last
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = cur
                    p = link[p]
                link[q] = cur
        else:
            cur = self._new_state(ln[last] + 1, 0, {}, 0)
            p = last
            while p != -1 and c not in nxt[p]:
                nxt[p][c] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][c]
                if ln[p] + 1 == ln[q]:
                    link[cur] = q
                else:
                    clone = self._clone(q, ln[p] + 1)
                    while p != -1 and nxt[p].get(c) == q:
                        nxt[p][c] = clone
                        p = link[p]
                    link[q] = clone
                    link[cur] = clone
        self._last[seq] = cur
        self._seq_len[seq] += 1
        self.num_tokens += 1

        # Move the count pointer to the new count_depth-suffix, then count the new end position
        # in every short state on its suffix-link chain.
        w0 = self._wstate[seq]
        k0 = self._wlen[seq]
        while w0 and k0 <= ln[link[w0]]:  # revalidate after clones
            w0 = link[w0]
        w, k = w0, k0
        if k == self.count_depth:
            k -= 1
            if k <= ln[link[w]]:
                w = link[w]
        w = nxt[w][c]
        k += 1
        self._wstate[seq] = w
        self._wlen[seq] = k
        count = self._count
        while w != -1:
            count[w] += 1
            w = link[w]
        # The contexts the token continues: the previous position's chain (those holding a
        # string ≤ count_depth - 1). Their continuation total and most frequent child.
        total = self._total
        best = self._best
        v = w0
        if v and ln[link[v]] >= self.count_depth - 1:
            v = link[v]
        while v != -1:
            total[v] += 1
            b = best[v]
            if b != c:
                nv = nxt[v]
                if b < 0 or count[nv[c]] > count[nv[b]]:
                    best[v] = c
            v = link[v]

    # -- queries ---------------------------------------------------------------------------------

    def suffix_state(self, seq: int, max_len: int) -> tuple[int, int]:
        """(state, length) of the suffix of sequence `seq` of length min(max_len, count_depth, L)."""
        ln = self._len
        link = self._link
        w = self._wstate[seq]
        k = self._wlen[seq]
        while w and k <= ln[link[w]]:
            w = link[w]
        self._wstate[seq] = w
        if max_len < k:
            return self.clamp(w, k, max_len)
        return w, k

    def clamp(self, state: int, length: int, max_len: int) -> tuple[int, int]:
        """Shorten the context (state, length) to its suffix of length ≤ max_len."""
        if length <= max_len:
            return state, length
        ln = self._len
        link = self._link
        while state and max_len <= ln[link[state]]:
            state = link[state]
        return state, max_len

    def match(self, pattern: Iterable[int], max_len: int) -> tuple[int, int]:
        """Longest suffix of `pattern` (capped at max_len) occurring in the sequences: its
        (state, length). Standard automaton matching, O(len(pattern)) amortised."""
        ln = self._len
        link = self._link
        nxt = self._next
        v, k = 0, 0
        max_len = min(max_len, self.count_depth)
        for t in pattern:
            t = int(t)
            while v and t not in nxt[v]:
                v = link[v]
                k = ln[v]
            x = nxt[v].get(t)
            if x is None:
                v, k = 0, 0
                continue
            v, k = x, k + 1
            if k > max_len:
                v, k = self.clamp(v, k, max_len)
        return v, k

    def with_continuation(self, state: int, length: int) -> tuple[int, int]:
        """Longest suffix of the context (state, length) that was ever followed by a token (an
        occurrence that is not the end of a sequence). (0, 0) if none, or if only the empty
        context has continuations."""
        ln = self._len
        link = self._link
        nxt = self._next
        while state and not nxt[state]:
            state = link[state]
            length = ln[state]
        return state, length

    def children(self, state: int) -> dict[int, int]:
        """token -> state of the context extended by that token (do not mutate)."""
        return self._next[state]

    def best_child(self, state: int) -> int:
        """Token of the most frequent continuation of the context (-1: none)."""
        return self._best[state]

    def continuation_total(self, state: int) -> int:
        """Occurrences of the context that have a continuation (Σ of its children's counts)."""
        return self._total[state]

    def count(self, state: int) -> int:
        """Occurrences of the strings of `state` (exact when they are ≤ count_depth long)."""
        return self._count[state]

    def state_length(self, state: int) -> int:
        return self._len[state]

    def state_link(self, state: int) -> int:
        return self._link[state]
