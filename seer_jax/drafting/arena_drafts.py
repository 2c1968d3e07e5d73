"""Compiled (numba) drafting over the array suffix automata of `arena_kernels`: the chains and
trees of `draft.build_draft`, `draft.merge_drafts`, and the match candidates and best-score choice
of `context.GroupDraftContext`, for many requests in one call, with the reference's
floating-point operations in the same order (identical drafts, scores and choices).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from seer_jax.drafting.arena_kernels import (
    BEST,
    BSTATE,
    COUNT,
    LEN,
    LINK,
    NCH,
    PRV,
    ROOT,
    TAIL,
    TGT,
    TOK,
    TOTAL,
    _clamp,
    _suffix_state,
    _with_continuation,
)


@njit(cache=True)
def _f32_sum(x, lo, n):
    """numpy's float32 sum of x[lo:lo + n] (its pairwise summation, bit for bit)."""
    if n < 8:
        r = np.float32(0.0)
        for i in range(n):
            r = np.float32(r + x[lo + i])
        return r
    if n <= 128:
        acc = np.empty(8, np.float32)
        for j in range(8):
            acc[j] = x[lo + j]
        i = 8
        while i < n - n % 8:
            for j in range(8):
                acc[j] = np.float32(acc[j] + x[lo + i + j])
            i += 8
        r = np.float32(np.float32(np.float32(acc[0] + acc[1]) + np.float32(acc[2] + acc[3]))
                       + np.float32(np.float32(acc[4] + acc[5]) + np.float32(acc[6] + acc[7])))
        while i < n:
            r = np.float32(r + x[lo + i])
            i += 1
        return r
    m = n // 2
    m -= m % 8
    return np.float32(_f32_sum(x, lo, m) + _f32_sum(x, lo + m, n - m))


@njit(cache=True)
def _chain(st, ed, root, state, length, max_nodes, max_depth, min_prob, cap, prior,
           otok, opar, oprob, odep, base):
    """`draft.build_draft` with width 1, written at [base, base + n); returns n."""
    n = 0
    prob = 1.0
    v = state
    k = length
    for _ in range(min(max_nodes, max_depth)):
        tok = st[v, BEST]
        if tok < 0:
            break
        x = st[v, BSTATE]
        prob *= st[x, COUNT] / (st[v, TOTAL] + prior)
        if prob < min_prob:
            break
        otok[base + n] = tok
        opar[base + n] = n - 1
        oprob[base + n] = np.float32(prob)
        odep[base + n] = n + 1
        n += 1
        v = x
        k += 1
        if k > cap:
            while v != root and cap <= st[st[v, LINK], LEN]:
                v = st[v, LINK]
            k = cap
    return n


@njit(cache=True)
def _push_children(st, ed, root, heap_p, heap_i, hsize, order, parent, v, k, prob, depth,
                   max_depth, width, min_prob, prior, rk_c, rk_b, rk_t, rk_s):
    """Push the top `width` continuations of (v, k) (`build_draft.push_children`)."""
    if depth >= max_depth or st[v, NCH] == 0:
        return hsize, order
    tot = st[v, TOTAL] + prior
    b = st[v, BEST]
    m = 0  # ranked so far, by (count, is best) descending; equal keys in list order (the list
    # is read from its last transition: one goes before those of equal key read so far)
    e = st[v, TAIL]
    while e >= 0:
        t = ed[e, TOK]
        s = ed[e, TGT]
        c = st[s, COUNT]
        isb = 1 if t == b else 0
        pos = m
        while pos > 0 and (rk_c[pos - 1] < c or (rk_c[pos - 1] == c and rk_b[pos - 1] <= isb)):
            pos -= 1
        if pos < width:
            last = min(m, width - 1)
            for j in range(last, pos, -1):
                rk_c[j] = rk_c[j - 1]
                rk_b[j] = rk_b[j - 1]
                rk_t[j] = rk_t[j - 1]
                rk_s[j] = rk_s[j - 1]
            rk_c[pos] = c
            rk_b[pos] = isb
            rk_t[pos] = t
            rk_s[pos] = s
            if m < width:
                m += 1
        e = ed[e, PRV]
    for j in range(m):
        p = prob * rk_c[j] / tot
        if p < min_prob:
            break
        order += 1
        heap_p[hsize] = p
        heap_i[hsize, 0] = order
        heap_i[hsize, 1] = parent
        heap_i[hsize, 2] = rk_t[j]
        heap_i[hsize, 3] = rk_s[j]
        heap_i[hsize, 4] = k + 1
        heap_i[hsize, 5] = depth + 1
        hsize += 1
    return hsize, order


@njit(cache=True)
def _tree(st, ed, root, state, length, max_nodes, max_depth, width, min_prob, cap,
          prior, otok, opar, oprob, odep, base):
    """`draft.build_draft` with width > 1 (best-first by path probability), at
    [base, base + n); returns n."""
    size = max_nodes * width + width + 1
    heap_p = np.empty(size, np.float64)
    heap_i = np.empty((size, 6), np.int64)
    rk_c = np.empty(width, np.int64)
    rk_b = np.empty(width, np.int64)
    rk_t = np.empty(width, np.int64)
    rk_s = np.empty(width, np.int64)
    hsize, order = _push_children(st, ed, root, heap_p, heap_i, 0, 0, -1, state, length, 1.0,
                                  0, max_depth, width, min_prob, prior, rk_c, rk_b, rk_t, rk_s)
    n = 0
    while hsize > 0 and n < max_nodes:
        top = 0  # highest probability, then lowest push order (the heap's (-p, order))
        for j in range(1, hsize):
            if heap_p[j] > heap_p[top] or (heap_p[j] == heap_p[top]
                                           and heap_i[j, 0] < heap_i[top, 0]):
                top = j
        p = heap_p[top]
        parent, t, s, k, depth = (heap_i[top, 1], heap_i[top, 2], heap_i[top, 3],
                                  heap_i[top, 4], heap_i[top, 5])
        hsize -= 1
        heap_p[top] = heap_p[hsize]
        heap_i[top] = heap_i[hsize]
        otok[base + n] = t
        opar[base + n] = parent
        oprob[base + n] = np.float32(p)
        odep[base + n] = depth
        idx = n
        n += 1
        if k > cap:
            s, k = _clamp(st, root, s, k, cap)
        hsize, order = _push_children(st, ed, root, heap_p, heap_i, hsize, order, idx, s, k, p,
                                      depth, max_depth, width, min_prob, prior, rk_c, rk_b,
                                      rk_t, rk_s)
    return n


@njit(cache=True)
def _merge(ctok, cpar, cprob, cdep, cn, cml, nc, mn, max_nodes, otok, opar, oprob, odep, base):
    """`draft.merge_drafts` of the candidates (each at [c * mn, c * mn + cn[c])), written at
    [base, base + n); returns (n, match_len)."""
    first = -1
    count = 0
    total = 0
    for c in range(nc):
        if cn[c] > 0:
            count += 1
            total += cn[c]
            if first < 0:
                first = c
    if count == 0:
        return 0, 0
    if count == 1:
        n = min(cn[first], max_nodes)
        for j in range(n):
            otok[base + j] = ctok[first * mn + j]
            opar[base + j] = cpar[first * mn + j]
            oprob[base + j] = cprob[first * mn + j]
            odep[base + j] = cdep[first * mn + j]
        return n, cml[first]
    mtok = np.empty(total, np.int64)
    mpar = np.empty(total, np.int64)
    mprob = np.empty(total, np.float64)
    mdep = np.empty(total, np.int64)
    local = np.empty(mn, np.int64)
    m = 0
    ml = 0
    for c in range(nc):
        if cn[c] == 0:
            continue
        ml = max(ml, cml[c])
        for j in range(cn[c]):
            t = ctok[c * mn + j]
            p = cpar[c * mn + j]
            pr = np.float64(cprob[c * mn + j])
            mp = local[p] if p >= 0 else -1
            node = -1
            for x in range(m):
                if mpar[x] == mp and mtok[x] == t:
                    node = x
                    break
            if node < 0:
                node = m
                m += 1
                mtok[node] = t
                mpar[node] = mp
                mprob[node] = pr
                mdep[node] = mdep[mp] + 1 if mp >= 0 else 1
            elif pr > mprob[node]:
                mprob[node] = pr
            local[j] = node
    # the max_nodes most probable (ties: shallower, then first merged), then by depth
    idx = np.arange(m)
    idx = idx[np.argsort(mdep[idx], kind="mergesort")]
    idx = idx[np.argsort(-mprob[idx], kind="mergesort")]
    keep = np.sort(idx[:max_nodes])
    keep = keep[np.argsort(-mprob[keep], kind="mergesort")]
    keep = keep[np.argsort(mdep[keep], kind="mergesort")]
    new = np.full(m, -1, np.int64)
    for j in range(keep.size):
        new[keep[j]] = j
    for j in range(keep.size):
        x = keep[j]
        otok[base + j] = mtok[x]
        opar[base + j] = new[mpar[x]] if mpar[x] >= 0 else -1
        oprob[base + j] = np.float32(mprob[x])
        odep[base + j] = mdep[x]
    return keep.size, ml


@njit(cache=True)
def suffix_states(st, sq, seqs, cap):
    """(roots, states, lengths) [R, 2] of the sequences seqs [R, 2] (-1: none, root -1): each
    one's suffix of length ≤ cap (`SuffixAutomaton.suffix_state`)."""
    roots = np.full(seqs.shape, -1, np.int64)
    states = np.zeros(seqs.shape, np.int64)
    lens = np.zeros(seqs.shape, np.int64)
    for i in range(seqs.shape[0]):
        for c in range(seqs.shape[1]):
            seq = seqs[i, c]
            if seq >= 0:
                roots[i, c] = sq[seq, ROOT]
                states[i, c], lens[i, c] = _suffix_state(st, sq, seq, cap)
    return roots, states, lens


@njit(cache=True)
def speculate(st, ed, roots, states, lens, max_nodes, max_depth, width, min_prob, cap,
              min_match_len, match_candidates, factor, offset, prior, merge):
    """Drafts of many requests (`GroupDraftContext.speculate`): row i drafts from the contexts
    (roots[i, c], states[i, c], lens[i, c]) for c = 0, 1 (the group's, its own; root -1:
    none). factor < 0: no max_spec_factor. Returns (starts [R + 1], n [R], match_len [R],
    tokens, parents, probs, depths); row i's nodes are at [starts[i], starts[i] + n[i])."""
    R = roots.shape[0]
    starts = np.zeros(R + 1, np.int64)
    for i in range(R):
        starts[i + 1] = starts[i] + max(max_nodes[i], 0)
    otok = np.empty(starts[R], np.int32)
    opar = np.empty(starts[R], np.int32)
    oprob = np.empty(starts[R], np.float32)
    odep = np.empty(starts[R], np.int32)
    on = np.zeros(R, np.int64)
    oml = np.zeros(R, np.int64)
    C = 2 * match_candidates
    for i in range(R):
        mn = max(max_nodes[i], 0)
        ctok = np.empty(C * mn, np.int32)
        cpar = np.empty(C * mn, np.int32)
        cprob = np.empty(C * mn, np.float32)
        cdep = np.empty(C * mn, np.int32)
        cn = np.zeros(C, np.int64)
        cml = np.zeros(C, np.int64)
        cscore = np.zeros(C, np.float32)
        nc = 0
        for ctx in range(roots.shape[1]):
            root = roots[i, ctx]
            if root < 0:
                continue
            state, length = _with_continuation(st, root, states[i, ctx], lens[i, ctx])
            if length < min_match_len or st[state, NCH] == 0:
                continue
            for _ in range(match_candidates):
                depth = max_depth[i]
                if factor >= 0:
                    depth = min(depth, int(np.floor(factor * length + offset)))
                cb = nc * mn
                n = 0
                if mn > 0 and depth > 0:
                    if width[i] <= 1:
                        n = _chain(st, ed, root, state, length, mn, depth, min_prob[i],
                                   cap, prior, ctok, cpar, cprob, cdep, cb)
                    else:
                        n = _tree(st, ed, root, state, length, mn, depth, width[i],
                                  min_prob[i], cap, prior, ctok, cpar, cprob, cdep, cb)
                cn[nc] = n
                cml[nc] = length
                cscore[nc] = _f32_sum(cprob, cb, n) if n else np.float32(0.0)
                nc += 1
                if state == root:
                    break
                state = st[state, LINK]
                state, length = _with_continuation(st, root, state, st[state, LEN])
                if length < min_match_len or state == root:
                    break
        b = starts[i]
        if nc == 0:
            continue
        if width[i] > 1 and merge and nc > 1:
            on[i], oml[i] = _merge(ctok, cpar, cprob, cdep, cn, cml, nc, mn, mn, otok, opar,
                                   oprob, odep, b)
            continue
        best = 0
        for c in range(1, nc):
            if cscore[c] > cscore[best]:
                best = c
        for j in range(cn[best]):
            otok[b + j] = ctok[best * mn + j]
            opar[b + j] = cpar[best * mn + j]
            oprob[b + j] = cprob[best * mn + j]
            odep[b + j] = cdep[best * mn + j]
        on[i] = cn[best]
        oml[i] = cml[best]
    return starts, on, oml, otok, opar, oprob, odep
