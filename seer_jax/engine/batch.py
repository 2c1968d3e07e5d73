"""The typed batch between the engine (host scheduling) and the model runner (device step).

`build_batch` lays one step out as padded arrays: a decode region of `n_dec` sequence slots of
`q_dec` query tokens each (1 for plain decode; [pending token, draft nodes...] when verifying a
speculative draft tree) followed by a prefill region of `t_pre` token slots over `n_pre`
sequences. Padding sizes come from a few buckets (`Layout`, `bucket`), so the runner compiles
few variants; this module owns those types and the runner imports them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from seer_jax.drafting.draft_rows import DraftRows


@dataclasses.dataclass(frozen=True)
class Layout:
    """A step's padded shape (a jit static argument of the runner's compiled steps)."""

    n_dec: int  # decode-region sequence slots
    q_dec: int  # max query tokens per decode sequence (1 = plain decode)
    n_pre: int  # prefill-region sequence slots
    t_pre: int  # prefill-region token slots
    pps: int  # pages per sequence in the page tables

    @property
    def num_tokens(self) -> int:
        return self.n_dec * self.q_dec + self.t_pre

    @property
    def num_rows(self) -> int:
        """Rows of logits: every decode-region token, plus one per prefill sequence."""
        return self.n_dec * self.q_dec + self.n_pre


def bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """The smallest minimum * 2**k >= n, capped at max(maximum, n)."""
    b = minimum
    while b < n:
        b *= 2
    return b if maximum is None else min(b, max(maximum, n))


def fine_bucket(n: int, minimum: int, maximum: int | None = None) -> int:
    """Like `bucket` but about 4 sizes per octave (8, 16, 24, ..., 64, 80, 96, 120, 144, ... for
    minimum 8): less padding for a slowly shrinking decode batch, for a few more compiles."""
    b = minimum
    while b < n:
        b += minimum * max(1, b // (4 * minimum))
    return b if maximum is None else min(b, max(maximum, n))


def uses_cpu_decode(impl: str, layout: Layout) -> bool:
    """Whether the decode region runs `cpu_attention.paged_decode_attention` (the `cpu` impl,
    plain one-token decode): its cost does not depend on the page-table width. `impl` is the
    runner's resolved impl (`ModelRunner.impl`)."""
    return layout.q_dec == 1 and impl == "cpu"


@dataclasses.dataclass(frozen=True)
class Region:
    """One region's ragged sequences: cu [n+1] int32 query offsets, kv_lens [n] int32,
    pages [n, pps] int32 page tables, num (how many slots are live). With `rows` [n] int32
    instead of `pages` (None), slot i's page table is row rows[i] of the persistent table
    (`RequestRows.pages`, kept on the device by the runner): nothing of width pps is built or
    sent for the step."""

    cu: np.ndarray
    kv_lens: np.ndarray
    pages: np.ndarray | None
    num: int
    rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """The decode region as draft trees: parents [n_dec * q_dec] int32 (the attention tree
    mask, -1 = the root), and per sequence its draft tokens/parents [n_dec, q_dec - 1] and
    num_draft [n_dec] (what acceptance checks)."""

    parents: np.ndarray
    tokens: np.ndarray | None = None  # None: a tree-masked forward without acceptance
    tree_parents: np.ndarray | None = None
    num_draft: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Everything the runner needs for one step (host numpy arrays).

    tokens, positions, slots: [layout.num_tokens] int32 (slot -1 = padding, KV not written);
    logits_index: [layout.num_rows] int32, the token whose logits each sampled row reads;
    temperature, top_p, top_k, seeds, gen_index: [num_rows] sampling parameters per row
    (gen_index: how many tokens the row's request has generated, for its PRNG stream).
    rows: (sequence, row) of every live sampled row, for the engine's bookkeeping.
    page_table: the persistent rows a region's `rows` index (None when every region carries
    its own page tables).
    token_src: [layout.num_tokens] int32 or None: where a token is still on the device (the
    sampled row of the previous, not yet committed step; -1 = `tokens` holds it).
    """

    layout: Layout
    tokens: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    logits_index: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    gen_index: np.ndarray
    dec: Region | None = None
    pre: Region | None = None
    draft: DraftTree | None = None
    rows: tuple = ()
    page_table: RequestRows | None = None
    token_src: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The flat name -> array dict the jitted step takes (a pytree of fixed structure for a
        given layout and draft presence)."""
        out = {name: getattr(self, name) for name in (
            "tokens", "positions", "slots", "logits_index", "temperature", "top_p", "top_k",
            "seeds", "gen_index")}
        for prefix, region in (("dec", self.dec), ("pre", self.pre)):
            if region is not None:
                out.update({f"{prefix}_cu": region.cu, f"{prefix}_kv_lens": region.kv_lens,
                            f"{prefix}_num": np.int32(region.num)})
                if region.pages is None:
                    out[f"{prefix}_rows"] = region.rows
                else:
                    out[f"{prefix}_pages"] = region.pages
        if self.draft is not None:
            out["dec_parents"] = self.draft.parents
            if self.draft.tokens is not None:
                out.update(draft_tokens=self.draft.tokens, draft_parents=self.draft.tree_parents,
                           num_draft=self.draft.num_draft)
        return out


def choose_layout(num_decode: int, prefill_tokens: int, max_pages: int, q_dec: int, *,
                  max_num_seqs: int, max_prefill_seqs: int, max_num_batched_tokens: int,
                  max_pps: int, impl: str) -> Layout:
    """The padded layout for a step (bucketed sizes)."""
    layout = Layout(
        n_dec=bucket(num_decode, 8, max_num_seqs) if num_decode else 0,
        q_dec=q_dec,
        n_pre=max_prefill_seqs if prefill_tokens else 0,
        t_pre=bucket(prefill_tokens, 16, max_num_batched_tokens) if prefill_tokens else 0,
        pps=bucket(max_pages, 4, max_pps),
    )
    if not prefill_tokens and uses_cpu_decode(impl, layout):
        # Decode-only steps on the CPU path: its cost follows the live lengths, not the table
        # width, so one full-width table and finer batch buckets (less padding as the batch
        # shrinks) keep the number of compiled variants small.
        layout = dataclasses.replace(
            layout, n_dec=fine_bucket(num_decode, 8, max_num_seqs), pps=max_pps)
    return layout


class RequestRows:
    """Per-request step inputs that persist across steps, one row per request that holds pages:
    its page table, prompt length and sampling parameters. A row is filled when its request gets
    pages (`acquire`) and then only the page entries that change are written (`set_pages`,
    `clear_pages`); a step's region page tables are gathers of these rows, and entries past a
    request's pages are 0.

    Once `tracking` is on (the runner holds a device copy of `pages`), every changed entry is
    also logged, so the copy is kept current by sending only those (`take_updates`)."""

    def __init__(self, num_rows: int, max_pps: int):
        self.pages = np.zeros((num_rows, max_pps), np.int32)
        self.tracking = False
        self._resized = False
        self._log: list[tuple[int, int]] = []  # (first flat index, entries) of each write
        self._log_size = 0
        self.temperature = np.zeros(num_rows, np.float32)
        self.top_p = np.ones(num_rows, np.float32)
        self.top_k = np.zeros(num_rows, np.int32)
        self.seeds = np.zeros(num_rows, np.uint32)
        self.prompt_len = np.zeros(num_rows, np.int32)
        self._free = list(range(num_rows - 1, -1, -1))

    def acquire(self, req) -> None:
        """Give req a row (if it has none) with its sampling parameters and page table."""
        if req.row >= 0:
            return
        if not self._free:
            self._grow()
        r = req.row = self._free.pop()
        sp = req.sampling
        self.temperature[r], self.top_p[r], self.top_k[r] = sp.temperature, sp.top_p, sp.top_k
        self.seeds[r] = sp.seed & 0xFFFFFFFF
        self.prompt_len[r] = len(req.prompt)
        self._write(r, 0, req.pages)

    def set_pages(self, req, start: int) -> None:
        """req.pages[start:] changed (appended)."""
        self._write(req.row, start, req.pages[start:])

    def clear_pages(self, req, start: int, end: int) -> None:
        """req's page entries [start, end) were given back."""
        self._write(req.row, start, np.zeros(max(0, end - start), np.int32))

    def release(self, req, num_pages: int) -> None:
        """req gives back its row (its first num_pages entries are cleared)."""
        if req.row >= 0:
            self._write(req.row, 0, np.zeros(num_pages, np.int32))
            self._free.append(req.row)
            req.row = -1

    def _write(self, row: int, start: int, values) -> None:
        """pages[row, start:start + len(values)] = values, logged when tracking."""
        n = len(values)
        if not n:
            return
        self.pages[row, start:start + n] = values
        if self.tracking and not self._resized:
            if self._log_size + n > self.pages.size:  # cheaper to send the whole table
                self._resized, self._log, self._log_size = True, [], 0
                return
            self._log.append((row * self.pages.shape[1] + start, n))
            self._log_size += n

    def take_updates(self) -> tuple[bool, np.ndarray, np.ndarray]:
        """What changed in `pages` since the last call: (whole table, or distinct flat indices
        [k] int32 into pages.reshape(-1), ascending, with their current values [k] int32); the
        log is emptied."""
        whole = self._resized
        # an entry written twice since the last sync (a row released and taken again) is sent
        # once, with its current value: a scatter with repeated indices applies them in an
        # unspecified order on TPU/GPU
        if self._log:
            first, n = np.array(self._log, np.int64).T
            # every written entry: each write's first index, then its next n - 1
            ends = np.cumsum(n)
            idx = np.unique(np.repeat(first - ends + n, n) + np.arange(ends[-1]))
        else:
            idx = np.zeros(0, np.int64)
        val = self.pages.reshape(-1)[idx]
        self._resized, self._log, self._log_size = False, [], 0
        return whole, idx.astype(np.int32), val.astype(np.int32)

    def _grow(self) -> None:
        n = len(self.temperature)
        self._resized, self._log, self._log_size = True, [], 0
        self.pages = np.concatenate([self.pages, np.zeros_like(self.pages)])
        for name in ("temperature", "top_p", "top_k", "seeds", "prompt_len"):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.full_like(old, 1 if name == "top_p" else 0)]))
        self._free.extend(range(2 * n - 1, n - 1, -1))


def build_batch(decode: Sequence[Any], prefill: Sequence[tuple[Any, int]], drafts,
                rows: RequestRows, *, page_size: int, max_num_seqs: int, max_prefill_seqs: int,
                max_num_batched_tokens: int, max_pps: int, impl: str) -> StepBatch:
    """Padded arrays for one step. `decode`: requests with one pending token; `prefill`:
    (request, tokens to compute). With `drafts` (one per decode request), each decode request
    carries [pending token, draft nodes...] as a token tree and every one of its tokens gets a
    logits row. Requests (`request.Request`) hold rows of `rows`: a region's page tables are
    those rows (`Region.rows`), which the runner reads from its device copy of `rows.pages`, so
    nothing of width pages-per-sequence is built or sent; the rest is gathered from the rows
    with a few array operations, whatever the batch size and context."""
    S = page_size
    n_dec = len(decode)
    if drafts is not None:
        drafts = DraftRows.from_drafts(drafts)
    q_dec = 1 if drafts is None else bucket(1 + int(drafts.lens.max(initial=0)), 2)
    d_rows = np.fromiter((s.row for s in decode), np.intp, n_dec)
    d_computed = np.fromiter((s.num_computed for s in decode), np.int32, n_dec)
    max_pages = max(max((len(s.pages) for s in decode), default=0),
                    max((len(s.pages) for s, _ in prefill), default=0))
    layout = choose_layout(n_dec, sum(n for _, n in prefill), max_pages, q_dec,
                           max_num_seqs=max_num_seqs, max_prefill_seqs=max_prefill_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, max_pps=max_pps,
                           impl=impl)
    N, R = layout.num_tokens, layout.num_rows
    tokens = np.zeros(N, np.int32)
    positions = np.zeros(N, np.int32)
    slots = np.full(N, -1, np.int32)
    logits_index = np.zeros(R, np.int32)
    temperature = np.zeros(R, np.float32)
    top_p = np.ones(R, np.float32)
    top_k = np.zeros(R, np.int32)
    seeds = np.zeros(R, np.uint32)
    gen_index = np.zeros(R, np.int32)
    row_of: list[tuple[Any, int]] = []
    token_src = None

    def sampling_rows(out_rows, req_rows, generated):
        temperature[out_rows], top_p[out_rows] = rows.temperature[req_rows], rows.top_p[req_rows]
        top_k[out_rows], seeds[out_rows] = rows.top_k[req_rows], rows.seeds[req_rows]
        gen_index[out_rows] = generated

    split = layout.n_dec * layout.q_dec
    dec = pre = tree = None
    if layout.n_dec:
        cu = np.zeros(layout.n_dec + 1, np.int32)
        kv_lens = np.zeros(layout.n_dec, np.int32)
        # page tables: rows of the persistent table, which the runner keeps on the device
        table_rows = np.zeros(layout.n_dec, np.int32)
        table_rows[:n_dec] = d_rows
        out_rows = np.arange(n_dec) * layout.q_dec
        # the pending token sits at position num_computed; the request has generated
        # num_computed + 1 - len(prompt) tokens
        sampling_rows(out_rows, d_rows, d_computed + 1 - rows.prompt_len[d_rows])
        row_of.extend(zip(decode, out_rows.tolist(), strict=True))
        if drafts is None:
            tokens[:n_dec] = np.fromiter((s.token_ids[s.num_computed] for s in decode), np.int32, n_dec)
            src = np.fromiter((s.pending_row for s in decode), np.int32, n_dec)
            if (src >= 0).any():  # sampled by the step still in flight: read on the device
                token_src = np.full(N, -1, np.int32)
                token_src[:n_dec] = src
            positions[:n_dec] = d_computed
            slots[:n_dec] = rows.pages[d_rows, d_computed // S] * S + d_computed % S
            cu[1:n_dec + 1] = np.arange(1, n_dec + 1)
            kv_lens[:n_dec] = d_computed + 1
            logits_index[:n_dec] = np.arange(n_dec)
        else:
            tree = _draft_region(layout, decode, drafts, rows, tokens, positions, slots,
                                 logits_index, cu, kv_lens, S)
        cu[n_dec + 1:] = cu[n_dec]
        dec = Region(cu, kv_lens, None, n_dec, table_rows)
    if layout.n_pre:
        cu = np.zeros(layout.n_pre + 1, np.int32)
        kv_lens = np.zeros(layout.n_pre, np.int32)
        table_rows = np.zeros(layout.n_pre, np.int32)
        t = split
        for i, (seq, n) in enumerate(prefill):
            start = seq.num_computed
            if seq.pending_row >= 0:
                raise ValueError(f"request {seq.request_id!r}: prefill while its last token is "
                                 "still on the device")
            pos = np.arange(start, start + n)
            tokens[t:t + n] = seq.token_ids[start:start + n]
            positions[t:t + n] = pos
            table = rows.pages[seq.row]
            slots[t:t + n] = table[pos // S] * S + pos % S
            cu[i + 1] = cu[i] + n
            kv_lens[i] = start + n
            table_rows[i] = seq.row
            t += n
            if start + n == seq.num_tokens:  # the last pending token: sample after it
                row = split + i
                logits_index[row] = t - 1
                sampling_rows(row, seq.row, len(seq.output))
                row_of.append((seq, row))
        cu[len(prefill) + 1:] = cu[len(prefill)]
        pre = Region(cu, kv_lens, None, len(prefill), table_rows)
    return StepBatch(layout, tokens, positions, slots, logits_index, temperature, top_p, top_k,
                     seeds, gen_index, dec, pre, tree, tuple(row_of), rows, token_src)


def _draft_region(layout: Layout, decode, drafts, rows: RequestRows, tokens, positions, slots,
                  logits_index, cu, kv_lens, S: int) -> DraftTree:
    """Lay the decode region out as [pending token, draft nodes...] per request (every
    request's tokens at once: array operations over the concatenated drafts)."""
    q = layout.q_dec
    nd = len(decode)
    parents = np.full(layout.n_dec * q, -1, np.int32)
    d_tokens = np.zeros((layout.n_dec, q - 1), np.int32)
    d_parents = np.full((layout.n_dec, q - 1), -1, np.int32)
    num_draft = np.zeros(layout.n_dec, np.int32)
    if any(seq.pending_row >= 0 for seq in decode):
        seq = next(seq for seq in decode if seq.pending_row >= 0)
        raise ValueError(f"request {seq.request_id!r}: drafts while its last token is still "
                         "on the device")
    lens = drafts.lens
    root = np.fromiter((s.num_computed for s in decode), np.int64, nd)
    seq_rows = np.fromiter((s.row for s in decode), np.intp, nd)
    width = 1 + lens
    first = np.cumsum(width) - width  # each request's first token (its pending one)
    total = int(width.sum())
    of = np.repeat(np.arange(nd), width)  # request of each token
    j = np.arange(total) - first[of]  # 0: the pending token, k: draft node k - 1
    node = j > 0
    if drafts.num_nodes:
        tokens[:total][node] = d_tokens[of[node], j[node] - 1] = drafts.tokens
        par = drafts.parents
        parents[:total][node] = par + 1  # relative to the pending token (0)
        d_parents[of[node], j[node] - 1] = par
        positions[:total][node] = root[of[node]] + drafts.depths
    tokens[first] = np.fromiter((s.token_ids[s.num_computed] for s in decode), np.int32, nd)
    positions[first] = root
    pos = root[of] + j
    slots[:total] = rows.pages[seq_rows[of], pos // S] * S + pos % S
    logits_index[of * q + j] = np.arange(total)
    kv_lens[:nd] = root + width
    cu[1:nd + 1] = np.cumsum(width)
    num_draft[:nd] = lens
    return DraftTree(parents, d_tokens, d_parents, num_draft)
