"""The group draft context on array suffix automata, drafting and appending many requests at once.

`ArenaDraftContext` is `GroupDraftContext` (same configuration, same methods, identical drafts:
tokens, parents, probabilities, depths and match lengths) with every automaton of the group (the
group's and each request's own) held in an `Arena` of numpy arrays (`arena_kernels`) and the
per-token work compiled with numba: `append_many` extends the automata with the tokens of many
requests in one call, `speculate_many` drafts for many requests in one call
(`arena_drafts.speculate`). A draft service keeps the contexts of all its groups in one arena, so
that the appends and drafts of every request of every group are one compiled call each
(`InProcessDraftService.append_rows`, `speculate_rows`). The draft services use it;
`GroupDraftContext` over `SuffixAutomaton` stays as the reference it is checked against
(tests/drafting).

Memory: the arena grows by doubling. A finished request's own automaton and a closed group's
automata are released; their states are dropped when released states outnumber live ones
(`Arena.compact`), and an arena with nothing live goes back to its first size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from seer_jax.drafting import arena_drafts as kd
from seer_jax.drafting import arena_kernels as ka
from seer_jax.drafting.context import DraftConfig, DraftMode
from seer_jax.drafting.draft import Draft
from seer_jax.drafting.draft_rows import DraftRows
from seer_jax.errors import InputError


def _token_array(tokens: list[int]) -> np.ndarray:
    """int32 token ids; InputError for ids outside [0, 2**31)."""
    try:
        arr = np.array(tokens, np.int32)
    except OverflowError:
        arr = None
    if arr is None or (arr.size and arr.min() < 0):
        raise InputError(f"token ids must be in [0, 2**31): got {min(tokens)}..{max(tokens)}")
    return arr


class Arena:
    """The arrays of many automata (`arena_kernels`): those of one group's context, or of every
    group of a draft service (then one compiled call appends, or drafts, for all of them).

    Automata that are no longer used (`release`: a finished request's own automaton, a closed
    group's) keep their states until dead states outnumber live ones (and `min_dead`): the
    arena is then compacted, so its memory follows what is live; with nothing live it goes back
    to its first size."""

    def __init__(self, min_dead: int = 1 << 16) -> None:
        self.min_dead = min_dead
        self.compactions = 0
        self._reset()

    def _reset(self) -> None:
        self.st = np.empty((64, ka.STATE_COLS), np.int32)
        self.ed = np.empty((64, 3), np.int32)
        self.ht = np.full((256, 2), -1, np.int64)
        self.meta = np.zeros(2, np.int64)  # states, transitions in use
        self.sq = np.empty((8, 6), np.int32)
        self.au = np.zeros((4, 2), np.int64)  # per automaton: states, positions appended
        self.live = np.zeros(4, bool)
        self.nseq = 0
        self.naut = 0
        self.num_live = 0
        self.dead_states = 0
        self._free_seqs: list[int] = []
        self._free_auts: list[int] = []
        self._released: list[int] = []  # dead automata whose states are still here

    def new_seq(self, row) -> int:
        if self._free_seqs:
            s = self._free_seqs.pop()
        else:
            if self.nseq == self.sq.shape[0]:
                self.sq = np.concatenate([self.sq, np.empty_like(self.sq)])
            s = self.nseq
            self.nseq += 1
        self.sq[s] = row
        return s

    def new_automaton(self) -> int:
        """A new empty automaton; its first (empty) sequence."""
        if self._free_auts:
            a = self._free_auts.pop()
        else:
            if self.naut == self.au.shape[0]:
                self.au = np.concatenate([self.au, np.zeros_like(self.au)])
                self.live = np.concatenate([self.live, np.zeros_like(self.live)])
            a = self.naut
            self.naut += 1
        self.live[a] = True
        self.num_live += 1
        *arrays, r = ka.new_root(self.st, self.ed, self.ht, self.meta, self.au, a)
        self._keep(*arrays)
        return self.new_seq((r, r, 0, 0, r, a))

    def release(self, seq: int) -> None:
        """The automaton of sequence `seq` is no longer used (drafted from or appended to)."""
        a = int(self.sq[seq, ka.AUT])
        if a < 0 or not self.live[a]:
            return
        self.live[a] = False
        self.num_live -= 1
        self.dead_states += int(self.au[a, 0])
        self._released.append(a)
        if not self.num_live:
            self._reset()
        elif self.dead_states >= max(self.min_dead, int(self.meta[0]) - self.dead_states):
            self.compact()

    def compact(self) -> None:
        """Drop the states of released automata; their ids and sequences are reused."""
        self._keep(*ka.compact(self.st, self.ed, self.meta, self.sq, self.nseq, self.live))
        aut = self.sq[:self.nseq, ka.AUT]
        dead = np.flatnonzero((aut >= 0) & ~self.live[np.maximum(aut, 0)])
        self.sq[dead, ka.AUT] = -1
        self._free_seqs += dead.tolist()
        self.au[self._released] = 0
        self._free_auts += self._released
        self._released = []
        self.dead_states = 0
        self.compactions += 1

    def extend(self, seqs: list[int], chunks: list) -> None:
        """Append chunks[i] (token lists or arrays) to sequence seqs[i], in order."""
        if not seqs:
            return
        flat: list[int] = []
        for c in chunks:
            flat += c.tolist() if isinstance(c, np.ndarray) else c
        if not flat:
            return
        toks = _token_array(flat)
        starts = np.zeros(len(chunks) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, chunks), np.int64, len(chunks)), out=starts[1:])
        self._keep(*ka.extend(self.st, self.ed, self.ht, self.meta, self.sq, self.au,
                              np.asarray(seqs, np.int64), starts, toks, self._cd))

    def _keep(self, st: np.ndarray, ed: np.ndarray, ht: np.ndarray) -> None:
        """Hold a kernel's arrays; one it allocated (grown, compacted) is copied once into
        numpy's memory, which asks the OS for huge pages for large arrays (numba's allocations
        do not): the kernels' random reads of a large arena then miss the TLB far less (a third
        of `extend`'s time at a few million states)."""
        self.st = st if st is self.st else st.copy()
        self.ed = ed if ed is self.ed else ed.copy()
        self.ht = ht if ht is self.ht else ht.copy()

    _cd = 0  # count depth (max_match_len + 1) of the contexts using the arena

    def draft_rows(self, config: DraftConfig, seqs: np.ndarray, max_nodes, max_depth, width,
                   min_prob) -> DraftRows:
        """Drafts of the sequence pairs seqs [R, 2] (the group's, the request's own; -1: none)
        with per-row max_nodes, max_depth, width, min_prob (arrays [R])."""
        roots, states, lens = kd.suffix_states(self.st, self.sq, seqs, config.max_match_len)
        return DraftRows.from_slots(*self._speculate(config, roots, states, lens, max_nodes,
                                                     max_depth, width, min_prob))

    def _speculate(self, cfg: DraftConfig, roots, states, lens, max_nodes, max_depth, width,
                   min_prob):
        factor = -1.0 if cfg.max_spec_factor is None else float(cfg.max_spec_factor)
        return kd.speculate(
            self.st, self.ed, roots, states, lens, max_nodes, max_depth,
            width, min_prob, cfg.max_match_len, cfg.min_match_len, cfg.match_candidates, factor,
            float(cfg.max_spec_offset), float(cfg.prior), cfg.merge_trees)

    def drafts_from(self, config: DraftConfig, roots, states, lens, max_nodes, max_depth, width,
                    min_prob) -> list[Draft]:
        starts, n, ml, tok, par, prob, dep = self._speculate(config, roots, states, lens,
                                                             max_nodes, max_depth, width, min_prob)
        for a in (tok, par, prob, dep):
            a.flags.writeable = False
        out = []
        empty = Draft.empty
        for s, k, m in zip(starts.tolist(), n.tolist(), ml.tolist(), strict=False):
            if k:
                e = s + k
                out.append(Draft(tok[s:e], par[s:e], prob[s:e], m, dep[s:e]))
            else:
                out.append(empty(m))
        return out


class ArenaDraftContext:
    """The draft context of one group (see module docstring and `GroupDraftContext`), in its
    own arena or in one shared with other groups of the same configuration (`arena`)."""

    def __init__(self, config: DraftConfig | None = None, prompt_ids: Iterable[int] = (),
                 arena: Arena | None = None) -> None:
        self.config = (config or DraftConfig()).validate()
        self._arena = arena if arena is not None else Arena()
        cd = self.config.max_match_len + 1
        if self._arena._cd not in (0, cd):
            raise InputError(f"an arena holds contexts of one max_match_len: {self._arena._cd - 1} "
                             f"!= {cd - 1}")
        self._arena._cd = cd
        self._prompt: list[int] = []
        self._requests: dict[str, int] = {}  # request -> its sequence in the group automaton
        self._own: dict[str, int] = {}  # request -> sequence 0 of its own automaton
        self._targets: dict[str, tuple[int, ...]] = {}  # request -> sequences it appends to
        self._group = self._arena.new_automaton() if self.config.mode == "group" else -1
        self._started = False
        prompt = list(prompt_ids)
        if prompt:
            self.set_prompt(prompt)

    def _extend(self, seqs: list[int], chunks: list) -> None:
        self._arena.extend(seqs, chunks)

    # -- building --------------------------------------------------------------------------------

    @property
    def mode(self) -> DraftMode:
        return self.config.mode

    @property
    def prompt_ids(self) -> list[int]:
        return list(self._prompt)

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests if self._group >= 0 else self._own)

    def set_prompt(self, prompt_ids: Iterable[int]) -> None:
        """Append to the group's prompt; only before any response token arrived."""
        toks = [int(t) for t in prompt_ids]
        if self._started:
            raise InputError("the group's prompt cannot change after responses started")
        self._prompt.extend(toks)
        if self._group >= 0:
            self._extend([self._group], [toks])

    def start_request(self, request_id: str) -> None:
        """Register a request (done implicitly by its first `append`)."""
        self._started = True
        if self._group >= 0 and request_id not in self._requests:
            self._requests[request_id] = self._arena.new_seq(self._arena.sq[self._group])
        if self._keeps_own() and request_id not in self._own:
            own = self._own[request_id] = self._arena.new_automaton()
            self._extend([own], [self._prompt])

    def _keeps_own(self) -> bool:
        return self._group < 0 or self.config.own_context

    def append(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Append generated tokens of a request."""
        self.append_many([(request_id, token_ids)])

    def append_many(self, items: Sequence[tuple[str, Iterable[int]]]) -> None:
        """Append generated tokens of several requests [(request_id, tokens)], in order, in
        one compiled call."""
        seqs: list[int] = []
        chunks: list = []
        self.collect(items, seqs, chunks)
        self._extend(seqs, chunks)

    def collect(self, items: Sequence[tuple[str, Iterable[int]]], seqs: list[int],
                chunks: list) -> None:
        """What `append_many` appends, added to (seqs, chunks) of this context's arena: the
        caller appends them (`Arena.extend`), with other contexts' of a shared arena."""
        targets = self._targets
        for rid, toks in items:
            tg = targets.get(rid)
            if tg is None:
                tg = self.targets(rid)
            if type(toks) is not list and not isinstance(toks, (tuple, np.ndarray)):
                toks = list(toks)
            for q in tg:
                seqs.append(q)
                chunks.append(toks)

    def targets(self, request_id: str) -> tuple[int, ...]:
        """The sequences a request's tokens are appended to, in order: its sequence in the
        group automaton, its own automaton (registering the request when it is new)."""
        tg = self._targets.get(request_id)
        if tg is None:
            own = self._own.get(request_id)
            if not self._started or (own is None and self._keeps_own()) or (
                    self._group >= 0 and request_id not in self._requests):
                self.start_request(request_id)
                own = self._own.get(request_id)
            tg = (((self._requests[request_id],) if self._group >= 0 else ())
                  + ((own,) if own is not None else ()))
            self._targets[request_id] = tg
        return tg

    def finish_request(self, request_id: str) -> None:
        """The request will not be drafted for again. Group mode keeps its tokens (its siblings
        still draft from them); its own automaton is no longer used or counted."""
        own = self._own.pop(request_id, None)
        self._targets.pop(request_id, None)
        if own is not None:
            self._arena.release(own)

    def close(self) -> None:
        """The group is over: its automata are released (`Arena.release`); the context is not
        used again."""
        for own in self._own.values():
            self._arena.release(own)
        self._own.clear()
        if self._group >= 0:
            self._arena.release(self._group)
            self._group = -1
        self._requests.clear()
        self._targets.clear()

    # -- queries ---------------------------------------------------------------------------------

    def _seqs(self, request_id: str) -> tuple[int, int]:
        """The sequences the request drafts from: the group's (-1: none), its own (-1: none)."""
        if request_id not in (self._requests if self._group >= 0 else self._own):
            self.start_request(request_id)
        return self._requests.get(request_id, -1), self._own.get(request_id, -1)

    def speculate(self, request_id: str, max_nodes: int = 8, max_depth: int = 8, width: int = 1,
                  min_prob: float | None = None) -> Draft:
        """See `GroupDraftContext.speculate`."""
        return self.speculate_many([(request_id, max_nodes, max_depth, width, min_prob)])[0]

    def speculate_many(self, queries: Sequence[tuple]) -> list[Draft]:
        """Drafts for [(request_id, max_nodes, max_depth, width, min_prob)], in one call."""
        if not queries:
            return []
        seqs = np.array([self._seqs(q[0]) for q in queries], np.int64).reshape(-1, 2)
        roots, states, lens = kd.suffix_states(self._arena.st, self._arena.sq, seqs,
                                               self.config.max_match_len)
        return self._drafts(roots, states, lens, queries)

    def speculate_pattern(self, pattern: Sequence[int], request_id: str | None = None,
                          max_nodes: int = 8, max_depth: int = 8, width: int = 1,
                          min_prob: float | None = None) -> Draft:
        """See `GroupDraftContext.speculate_pattern`."""
        if self._group < 0 and request_id is None:
            raise InputError("per_request mode needs a request_id to draft from")
        if self._group < 0:
            seqs = [self._seqs(request_id)[1]]
        else:
            seqs = [self._group] + ([self._own[request_id]] if request_id in self._own else [])
        cap = self.config.max_match_len
        pat = _token_array(list(pattern)[-cap:]).astype(np.int64)
        roots = np.full((1, 2), -1, np.int64)
        states = np.zeros((1, 2), np.int64)
        lens = np.zeros((1, 2), np.int64)
        for c, seq in enumerate(seqs):
            ar = self._arena
            root = int(ar.sq[seq, ka.ROOT])
            roots[0, c] = root
            states[0, c], lens[0, c] = ka.match(ar.st, ar.ht, root, pat, cap,
                                                ar._cd)
        return self._drafts(roots, states, lens, [(request_id, max_nodes, max_depth, width,
                                                   min_prob)])[0]

    def _drafts(self, roots, states, lens, queries) -> list[Draft]:
        mp = self.config.min_prob
        q = len(queries)
        max_nodes = np.fromiter((x[1] for x in queries), np.int64, q)
        max_depth = np.fromiter((x[2] for x in queries), np.int64, q)
        width = np.fromiter((x[3] for x in queries), np.int64, q)
        min_prob = np.fromiter((mp if x[4] is None else x[4] for x in queries), np.float64, q)
        return self._arena.drafts_from(self.config, roots, states, lens, max_nodes, max_depth,
                                       width, min_prob)

    # -- stats -----------------------------------------------------------------------------------

    def _automata(self) -> list[int]:
        seqs = list(self._own.values()) + ([self._group] if self._group >= 0 else [])
        return [int(self._arena.sq[s, ka.AUT]) for s in seqs]

    def num_tokens(self) -> int:
        """Positions indexed (group mode: prompt once + every response)."""
        return int(sum(self._arena.au[a, 1] for a in self._automata()))

    def num_states(self) -> int:
        return int(sum(self._arena.au[a, 0] for a in self._automata()))


def compile_kernels() -> None:
    """Compile (or load from numba's on-disk cache) every kernel the contexts use, by drafting
    from a small context: a process that does this first writes the cache that processes
    started after it load."""
    for mode in ("group", "per_request"):
        ctx = ArenaDraftContext(DraftConfig(mode=mode), [1, 2, 3, 1, 2])
        ctx.append_many([("a", [3, 1]), ("b", [2])])
        ctx.speculate_many([("a", 8, 8, 1, None), ("b", 8, 8, 2, None)])
        ctx.speculate_pattern([1, 2], "a")
