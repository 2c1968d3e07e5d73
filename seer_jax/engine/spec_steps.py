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

from seer_jax.drafting.draft_rows import DraftRows
from seer_jax.engine.block_manager import OutOfPages

if TYPE_CHECKING:
    from seer_jax.engine.kv_cache import KVCacheManager
    from seer_jax.engine.request import Request
    from seer_jax.engine.speculation import Speculator


def propose(spec: Speculator, kv: KVCacheManager, decode: list[Request], max_model_len: int):
    """Drafts for the decode batch (`DraftRows`; None: no speculation this step). Each draft
    fits the request's remaining token budget and context, and its verify pages are
    allocated."""
    n = len(decode)
    num_tokens = np.fromiter((s.num_tokens for s in decode), np.int64, n)
    new = np.fromiter((s.num_tokens - len(s.prompt) - s.base_len for s in decode), np.int64, n)
    budget = np.fromiter((s.max_tokens for s in decode), np.int64, n)
    drafts = spec.propose(decode, np.minimum(budget - new, max_model_len - num_tokens) - 1)
    if drafts is None:
        return None
    drafts = DraftRows.from_drafts(drafts)
    lens = drafts.lens
    keep = np.minimum(lens, np.maximum(max_model_len - num_tokens, 0))
    S = kv.page_size
    computed = np.fromiter((s.num_computed for s in decode), np.int64, n)
    held = np.fromiter((len(s.pages) for s in decode), np.int64, n) * S
    for i in np.flatnonzero((keep > 0) & (held < computed + 1 + keep)).tolist():
        try:  # (only the requests whose verified nodes need another page)
            kv.grow(decode[i], int(computed[i] + 1 + keep[i]))
        except OutOfPages:
            keep[i] = 0
    drafts = drafts.truncate(keep)
    return drafts if drafts.num_nodes else None


# an emission whose end (EOS, stop id, budget) the commit still has to find (`Engine._emit`)
UNCHECKED = "unchecked"
_REASONS = (None, "eos", "stop", "length")


def accept(decode: list[Request], drafts, outputs, kv: KVCacheManager, runner,
           spec: Speculator, eos_ids: tuple[int, ...] = ()) -> list[tuple]:
    """Commit a verified decode region: each request's accepted path moves into consecutive
    cache slots, `num_computed` advances by 1 + accepted, the budget learns the acceptance.
    Returns the emissions (request, tokens, logprobs, (), -1, end reason) in batch order: each
    request's accepted tokens up to the first that ends it (EOS, a stop id, its budget's last),
    found for the whole batch at once."""
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
    toks, lps = d_toks[:n], d_lps[:n]
    # the first token that ends each request: EOS, a stop id, or its budget's last (in that
    # order at the same token)
    k = np.arange(toks.shape[1])
    take = acc + 1
    room = np.fromiter((s.max_tokens - len(s.output) + s.base_len for s in decode), np.int64, n)
    cut = np.minimum(take, np.maximum(room, 1))
    code = np.where(room <= take, 3, 0)
    hit = np.zeros(toks.shape, bool)
    if eos_ids:
        hit = np.isin(toks, eos_ids) & (k < take[:, None])
    stop = hit.copy()
    for i, seq in enumerate(decode):  # (stop ids are per request; most have none)
        ids = seq.sampling.stop_token_ids
        if ids:
            stop[i] |= np.isin(toks[i], ids) & (k < take[i])
    if stop.any():
        first = np.where(stop.any(1), stop.argmax(1), toks.shape[1])
        at = first < cut  # the length's last token is cut - 1: at the same token EOS wins
        cut = np.where(at, first + 1, cut)
        is_eos = hit[np.arange(n), np.minimum(first, toks.shape[1] - 1)]
        code = np.where(at, np.where(is_eos, 1, 2), code)
    keep = k < cut[:, None]
    flat_t, flat_l = toks[keep].tolist(), lps[keep].tolist()
    ends = np.cumsum(cut).tolist()
    lens = drafts.lens.tolist()
    emissions = []
    s = 0
    for seq, nd, a, e, c in zip(decode, lens, acc.tolist(), ends, code.tolist(), strict=True):
        seq.num_computed += 1 + a
        m = seq.metrics
        m.spec_proposed += nd
        m.spec_accepted += a
        emissions.append((seq, flat_t[s:e], flat_l[s:e], (), -1, _REASONS[c]))
        s = e
    spec.observe(drafts, acc.tolist(), sum(lens))
    return emissions
