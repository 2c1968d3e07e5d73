"""The engine's speculative steps: drafts for a decode batch (with the pages their verification
writes) and the bookkeeping of a verified step (accepted tokens, the accepted tree path moved
into consecutive cache slots), done over the whole batch with array operations.

A verified step decides how many tokens each of its requests advances, so the engine plans the
step after it only once it is committed (`Engine._step_overlapped`); everything here is on that
path and costs a few array operations per step, not per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from seer_jax.engine.block_manager import OutOfPages

if TYPE_CHECKING:
    from seer_jax.engine.kv_cache import KVCacheManager
    from seer_jax.engine.request import Request
    from seer_jax.engine.speculation import Speculator


def propose(spec: Speculator, kv: KVCacheManager, decode: list[Request], max_model_len: int):
    """Drafts for the decode batch (None: no speculation this step). Each draft fits the
    request's remaining token budget and context, and its verify pages are allocated."""
    limits = [min(s.max_tokens - s.num_new, max_model_len - s.num_tokens) - 1 for s in decode]
    drafts = spec.propose(decode, limits)
    if drafts is None:
        return None
    out = []
    S = kv.page_size
    for seq, d in zip(decode, drafts, strict=True):
        n = len(d)
        if n:
            room = max_model_len - seq.num_tokens
            if n > room:
                d = d.truncate(max(room, 0))
                n = len(d)
            if len(seq.pages) * S < seq.num_computed + 1 + n:
                try:
                    kv.grow(seq, seq.num_computed + 1 + n)
                except OutOfPages:
                    d = d.truncate(0)
                    n = 0
        out.append(d)
    return out if any(len(d) for d in out) else None


def accept(decode: list[Request], drafts, outputs, kv: KVCacheManager, runner,
           spec: Speculator) -> list[tuple]:
    """Commit a verified decode region: each request's accepted path moves into consecutive
    cache slots, `num_computed` advances by 1 + accepted, the budget learns the acceptance.
    Returns the emissions (request, tokens, logprobs, [], -1) in batch order."""
    d_toks, d_lps, n_acc, acc_nodes = outputs
    n = len(decode)
    acc = n_acc[:n].astype(np.int64)
    if n and acc_nodes.shape[1]:
        k = np.arange(acc_nodes.shape[1])
        nodes = acc_nodes[:n]
        moved = (k[None, :] < acc[:, None]) & (nodes != k[None, :])
        if moved.any():  # compact the accepted tree path into consecutive slots
            rows = np.fromiter((s.row for s in decode), np.intp, n)
            root = np.fromiter((s.num_computed for s in decode), np.int64, n) + 1
            i, j = np.nonzero(moved)
            S, table = kv.page_size, kv.rows.pages
            src = root[i] + nodes[i, j]
            dst = root[i] + j
            runner.move_slots(table[rows[i], src // S] * S + src % S,
                              table[rows[i], dst // S] * S + dst % S)
    accepted = acc.tolist()
    toks, lps = d_toks[:n].tolist(), d_lps[:n].tolist()
    lens = [len(d) for d in drafts]
    emissions = []
    for seq, nd, a, t, lp in zip(decode, lens, accepted, toks, lps, strict=True):
        seq.num_computed += 1 + a
        m = seq.metrics
        m.spec_proposed += nd
        m.spec_accepted += a
        emissions.append((seq, t[:a + 1], lp[:a + 1], [], -1))
    spec.observe(drafts, accepted, sum(lens))
    return emissions
