"""Compiled (numba) kernels of the array suffix automata (`arena.ArenaDraftContext`).

The automata of one group's draft context, or of every group of a draft service, live in one
arena of arrays:

- states `st` int32 [capacity, 9]: longest length, suffix link (-1 at a root), occurrence
  count, continuation total, most frequent continuation (-1: none) and its target state, last
  outgoing transition, number of transitions, the automaton the state belongs to;
- transitions `ed` int32 [capacity, 3]: token, target state, the state's previous transition
  (-1: its first): its transitions form a list in insertion order, the order in which a Python
  dict would hold them (ties between equally frequent continuations are broken by it), linked
  from the last so that adding one writes no other transition;
- a hash table `ht` int64 [power of 2, 2] from (state, token) to the transition: per slot the
  key state << 32 | token (-1: empty) and the value target << 32 | transition, side by side so
  that a lookup reads one cache line and needs no read of `ed` for the target (`_split`, which
  redirects transitions, updates both);
- sequences `sq` int32 [capacity, 6]: last state, count pointer (state, length), length,
  root state and automaton of the sequence;
- automata `au` int64 [capacity, 2]: states and appended positions of each;
- `meta` int64 [2]: states and transitions in use.

The algorithms are those of `suffix_automaton.SuffixAutomaton` and `draft.build_draft` /
`draft.merge_drafts` / `context.GroupDraftContext` (the reference implementation), step for step,
with the same floating-point operations in the same order, so that drafts are identical; a root
is any state whose link is -1 (the reference's state 0). Kernels that may add states or
transitions return the arena's arrays (grown when full).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# state columns
LEN, LINK, COUNT, TOTAL, BEST, BSTATE, TAIL, NCH, OWNER = range(9)
STATE_COLS = 9
# transition columns
TOK, TGT, PRV = range(3)
# sequence columns
LAST, WSTATE, WLEN, SEQLEN, ROOT, AUT = range(6)

_MUL = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, inline="always")
def _slot(key, mask):
    return np.int64((np.uint64(key) * _MUL) >> np.uint64(29)) & mask


@njit(cache=True)
def _find(ht, v, c):
    """The hash slot of the transition (state v, token c); none: -1 - the free slot where it
    would go (`_add_edge`)."""
    key = (np.int64(v) << 32) | np.int64(c)
    mask = ht.shape[0] - 1
    i = _slot(key, mask)
    while True:
        k = ht[i, 0]
        if k == key:
            return i
        if k == -1:
            return -1 - i
        i = (i + 1) & mask


@njit(cache=True)
def _get(ht, v, c):
    """The target of the transition (state v, token c), -1: none."""
    i = _find(ht, v, c)
    return ht[i, 1] >> 32 if i >= 0 else -1


@njit(cache=True)
def _hash_put(ht, key, val):
    mask = ht.shape[0] - 1
    i = _slot(key, mask)
    while ht[i, 0] != -1:
        i = (i + 1) & mask
    ht[i, 0] = key
    ht[i, 1] = val


@njit(cache=True, inline="always")
def _full(st, ed, ht, meta, ns, ne):
    """Whether the arena lacks room for ns more states or ne more transitions."""
    return (meta[0] + ns >= st.shape[0] or meta[1] + ne >= ed.shape[0]
            or 2 * (meta[1] + ne) >= ht.shape[0])


@njit(cache=True)
def _room(st, ed, ht, meta, ns, ne):
    """The arena's arrays, grown (doubled) to hold ns more states and ne more transitions.
    (Called only when `_full`: returning arrays costs more than the check.)"""
    while meta[0] + ns >= st.shape[0]:
        big = np.empty((2 * st.shape[0], st.shape[1]), np.int32)
        big[:st.shape[0]] = st
        st = big
    while meta[1] + ne >= ed.shape[0]:
        big = np.empty((2 * ed.shape[0], ed.shape[1]), np.int32)
        big[:ed.shape[0]] = ed
        ed = big
    size = ht.shape[0]
    while 2 * (meta[1] + ne) >= size:
        size *= 2
    if size != ht.shape[0]:
        ht2 = _empty_table(size)
        for i in range(ht.shape[0]):
            if ht[i, 0] != -1:
                _hash_put(ht2, ht[i, 0], ht[i, 1])
        ht = ht2
    return st, ed, ht


@njit(cache=True)
def _empty_table(size):
    ht = np.empty((size, 2), np.int64)
    ht[:, 0] = -1
    return ht


@njit(cache=True)
def _add_edge(st, ed, ht, meta, v, c, tgt, slot):
    """A new transition v --c--> tgt, last in v's list, at its free hash slot (`_find`; room
    must have been made)."""
    e = meta[1]
    meta[1] += 1
    ed[e, TOK] = c
    ed[e, TGT] = tgt
    ed[e, PRV] = st[v, TAIL]
    st[v, TAIL] = e
    st[v, NCH] += 1
    ht[slot, 0] = (np.int64(v) << 32) | np.int64(c)
    ht[slot, 1] = (np.int64(tgt) << 32) | e


@njit(cache=True)
def _new_state(st, meta, au, a, length, link, count, total, best, bstate):
    s = meta[0]
    meta[0] += 1
    au[a, 0] += 1
    st[s, LEN] = length
    st[s, LINK] = link
    st[s, COUNT] = count
    st[s, TOTAL] = total
    st[s, BEST] = best
    st[s, BSTATE] = bstate
    st[s, TAIL] = -1
    st[s, NCH] = 0
    st[s, OWNER] = a
    return s


@njit(cache=True)
def new_root(st, ed, ht, meta, au, a):
    if _full(st, ed, ht, meta, 1, 1):
        st, ed, ht = _room(st, ed, ht, meta, 1, 1)
    r = _new_state(st, meta, au, a, 0, -1, 0, 0, -1, -1)
    return st, ed, ht, r


@njit(cache=True)
def _clone(st, ed, ht, meta, au, a, q, length):
    """A new state with q's transitions (in q's order) and statistics (room for 1 state and
    q's transitions must have been made)."""
    s = _new_state(st, meta, au, a, length, st[q, LINK], st[q, COUNT], st[q, TOTAL], st[q, BEST],
                   st[q, BSTATE])
    n = st[q, NCH]
    e0 = meta[1]
    meta[1] += n
    j = e0 + n - 1  # the clone's list: q's transitions at [e0, e0 + n), filled from the last
    e = st[q, TAIL]
    while e >= 0:
        ed[j, TOK] = ed[e, TOK]
        ed[j, TGT] = ed[e, TGT]
        ed[j, PRV] = j - 1 if j > e0 else -1
        _hash_put(ht, (np.int64(s) << 32) | np.int64(ed[e, TOK]), (np.int64(ed[e, TGT]) << 32) | j)
        j -= 1
        e = ed[e, PRV]
    st[s, TAIL] = e0 + n - 1 if n else -1
    st[s, NCH] = n
    return s


@njit(cache=True)
def _split(st, ed, ht, meta, au, a, p, q, c, length):
    """Clone q at `length`, redirect the c-transitions to q from p and its suffix links to the
    clone, and make the clone q's link (making room first). Returns the arena's arrays and the
    clone."""
    if _full(st, ed, ht, meta, 1, st[q, NCH]):
        st, ed, ht = _room(st, ed, ht, meta, 1, st[q, NCH])
    cl = _clone(st, ed, ht, meta, au, a, q, length)
    while p != -1:
        i = _find(ht, p, c)
        if i < 0 or ht[i, 1] >> 32 != q:
            break
        e = ht[i, 1] & 0xFFFFFFFF
        ed[e, TGT] = cl
        ht[i, 1] = (np.int64(cl) << 32) | e
        if st[p, BEST] == c:
            st[p, BSTATE] = cl
        p = st[p, LINK]
    st[q, LINK] = cl
    return st, ed, ht, cl


@njit(cache=True)
def extend(st, ed, ht, meta, sq, au, seqs, starts, tokens, cd):
    """Append tokens[starts[i]:starts[i + 1]] to sequence seqs[i], for each i in order
    (`SuffixAutomaton.extend`, root = the sequence's root). Returns the arena's arrays."""
    for i in range(seqs.size):
        seq = seqs[i]
        a = sq[seq, AUT]
        root = sq[seq, ROOT]
        for j in range(starts[i], starts[i + 1]):
            c = tokens[j]
            last = sq[seq, LAST]
            h = _find(ht, last, c)
            if h >= 0:
                q = ht[h, 1] >> 32
                if st[q, LEN] == st[last, LEN] + 1:
                    cur = q
                else:
                    st, ed, ht, cur = _split(st, ed, ht, meta, au, a, last, q, c,
                                             st[last, LEN] + 1)
            else:
                if _full(st, ed, ht, meta, 1, 1):
                    st, ed, ht = _room(st, ed, ht, meta, 1, 1)
                    h = _find(ht, last, c)
                cur = _new_state(st, meta, au, a, st[last, LEN] + 1, root, 0, 0, -1, -1)
                # last has no c-transition (looked up above); its suffix links until one has
                _add_edge(st, ed, ht, meta, last, c, cur, -1 - h)
                p = st[last, LINK]
                while p != -1:
                    if _full(st, ed, ht, meta, 0, 1):
                        st, ed, ht = _room(st, ed, ht, meta, 0, 1)
                    h = _find(ht, p, c)
                    if h >= 0:
                        break
                    _add_edge(st, ed, ht, meta, p, c, cur, -1 - h)
                    p = st[p, LINK]
                if p != -1:
                    q = ht[h, 1] >> 32
                    if st[p, LEN] + 1 == st[q, LEN]:
                        st[cur, LINK] = q
                    else:
                        st, ed, ht, cl = _split(st, ed, ht, meta, au, a, p, q, c,
                                                st[p, LEN] + 1)
                        st[cur, LINK] = cl
            sq[seq, LAST] = cur
            sq[seq, SEQLEN] += 1
            au[a, 1] += 1
            _count(st, ht, sq, seq, root, c, cd)
    return st, ed, ht


@njit(cache=True)
def _count(st, ht, sq, seq, root, c, cd):
    # the count pointer moves to the new count_depth-suffix; the new end position is counted
    # in every short state of its suffix-link chain
    w0 = sq[seq, WSTATE]
    k0 = sq[seq, WLEN]
    while w0 != root and k0 <= st[st[w0, LINK], LEN]:
        w0 = st[w0, LINK]
    w = w0
    k = k0
    if k == cd:
        k -= 1
        if k <= st[st[w, LINK], LEN]:
            w = st[w, LINK]
    w = _get(ht, w, c)
    k += 1
    sq[seq, WSTATE] = w
    sq[seq, WLEN] = k
    while w != -1:
        st[w, COUNT] += 1
        w = st[w, LINK]
    # the contexts the token continues: their continuation totals and most frequent child.
    # Context v's child by c holds the new sequence's suffixes v·c, so it is on the chain just
    # counted: x follows that chain down, to the state holding the length of v's shortest
    # string + 1 (no lookup by hash)
    x = sq[seq, WSTATE]
    v = w0
    if v != root and st[st[v, LINK], LEN] >= cd - 1:
        v = st[v, LINK]
    while v != -1:
        st[v, TOTAL] += 1
        b = st[v, BEST]
        if b != c:
            need = st[st[v, LINK], LEN] + 2 if v != root else 1
            while st[x, LINK] >= 0 and st[st[x, LINK], LEN] >= need:
                x = st[x, LINK]
            if b < 0 or st[x, COUNT] > st[st[v, BSTATE], COUNT]:
                st[v, BEST] = c
                st[v, BSTATE] = x
        v = st[v, LINK]


@njit(cache=True)
def compact(st, ed, meta, sq, nseq, live):
    """The arena without the states (and their transitions) of the automata a with live[a]
    false: live states keep their order and each state's transitions their list order (so
    drafts do not change); the sequences of live automata are renumbered in place. Returns
    new (st, ed, ht), sized for what is left."""
    ns = meta[0]
    new = np.full(ns, -1, np.int64)
    k = 0
    ne = 0
    for s in range(ns):
        if live[st[s, OWNER]]:
            new[s] = k
            k += 1
            ne += st[s, NCH]
    cap_s = 64
    while cap_s <= k:
        cap_s *= 2
    cap_e = 64
    while cap_e <= ne:
        cap_e *= 2
    size = 256
    while 2 * ne >= size:
        size *= 2
    st2 = np.empty((cap_s, st.shape[1]), np.int32)
    ed2 = np.empty((cap_e, ed.shape[1]), np.int32)
    ht2 = _empty_table(size)
    for s in range(ns):
        t = new[s]
        if t >= 0:
            st2[t] = st[s]
            link = st[s, LINK]
            st2[t, LINK] = new[link] if link >= 0 else -1
            b = st[s, BSTATE]
            st2[t, BSTATE] = new[b] if b >= 0 else -1
    meta[0] = k
    meta[1] = 0
    for s in range(ns):
        t = new[s]
        if t >= 0:
            n = st[s, NCH]
            e0 = meta[1]
            meta[1] += n
            j = e0 + n - 1
            e = st[s, TAIL]
            while e >= 0:
                tgt = new[ed[e, TGT]]
                ed2[j, TOK] = ed[e, TOK]
                ed2[j, TGT] = tgt
                ed2[j, PRV] = j - 1 if j > e0 else -1
                _hash_put(ht2, (np.int64(t) << 32) | np.int64(ed[e, TOK]), (tgt << 32) | j)
                j -= 1
                e = ed[e, PRV]
            st2[t, TAIL] = e0 + n - 1 if n else -1
    for q in range(nseq):
        a = sq[q, AUT]
        if a >= 0 and live[a]:
            for col in (LAST, WSTATE, ROOT):
                if sq[q, col] >= 0:
                    sq[q, col] = new[sq[q, col]]
    return st2, ed2, ht2


@njit(cache=True)
def _clamp(st, root, state, length, max_len):
    if length <= max_len:
        return state, length
    while state != root and max_len <= st[st[state, LINK], LEN]:
        state = st[state, LINK]
    return state, max_len


@njit(cache=True)
def _suffix_state(st, sq, seq, max_len):
    root = sq[seq, ROOT]
    w = sq[seq, WSTATE]
    k = sq[seq, WLEN]
    while w != root and k <= st[st[w, LINK], LEN]:
        w = st[w, LINK]
    sq[seq, WSTATE] = w
    if max_len < k:
        return _clamp(st, root, w, k, max_len)
    return w, k


@njit(cache=True)
def match(st, ht, root, pattern, max_len, cd):
    """Longest suffix of `pattern` (≤ max_len) occurring in the automaton at `root`."""
    v = root
    k = 0
    max_len = min(max_len, cd)
    for t in pattern:
        i = _find(ht, v, t)
        while v != root and i < 0:
            v = st[v, LINK]
            k = st[v, LEN]
            i = _find(ht, v, t)
        if i < 0:
            v = root
            k = 0
            continue
        v = ht[i, 1] >> 32
        k += 1
        if k > max_len:
            v, k = _clamp(st, root, v, k, max_len)
    return v, k


@njit(cache=True)
def _with_continuation(st, root, state, length):
    while state != root and st[state, NCH] == 0:
        state = st[state, LINK]
        length = st[state, LEN]
    return state, length
