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
    pages [n, pps] int32 page tables, num (how many slots are live)."""

    cu: np.ndarray
    kv_lens: np.ndarray
    pages: np.ndarray
    num: int


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

    def arrays(self) -> dict[str, np.ndarray]:
        """The flat name -> array dict the jitted step takes (a pytree of fixed structure for a
        given layout and draft presence)."""
        out = {name: getattr(self, name) for name in (
            "tokens", "positions", "slots", "logits_index", "temperature", "top_p", "top_k",
            "seeds", "gen_index")}
        for prefix, region in (("dec", self.dec), ("pre", self.pre)):
            if region is not None:
                out.update({f"{prefix}_cu": region.cu, f"{prefix}_kv_lens": region.kv_lens,
                            f"{prefix}_pages": region.pages, f"{prefix}_num": np.int32(region.num)})
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


def build_batch(decode: Sequence[Any], prefill: Sequence[tuple[Any, int]], drafts, *,
                page_size: int, max_num_seqs: int, max_prefill_seqs: int,
                max_num_batched_tokens: int, max_pps: int, impl: str) -> StepBatch:
    """Padded arrays for one step. `decode`: sequences with one pending token; `prefill`:
    (sequence, tokens to compute). With `drafts` (one per decode sequence), each decode
    sequence carries [pending token, draft nodes...] as a token tree and every one of its tokens
    gets a logits row. A sequence exposes `tokens`, `num_computed`, `pages`, `sampling` and
    `output`."""
    S = page_size
    all_seqs = list(decode) + [s for s, _ in prefill]
    q_dec = 1 if drafts is None else bucket(1 + max(len(d) for d in drafts), 2)
    layout = choose_layout(len(decode), sum(n for _, n in prefill),
                           max(len(s.pages) for s in all_seqs), q_dec,
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
    rows: list[tuple[Any, int]] = []

    def set_row(row, seq):
        sp = seq.sampling
        temperature[row], top_p[row], top_k[row] = sp.temperature, sp.top_p, sp.top_k
        seeds[row] = sp.seed & 0xFFFFFFFF
        gen_index[row] = len(seq.output)

    def region(n_slots, items, token_start, row_start, row_stride=1) -> Region:
        cu = np.zeros(n_slots + 1, np.int32)
        kv_lens = np.zeros(n_slots, np.int32)
        pages = np.zeros((n_slots, layout.pps), np.int32)
        t = token_start
        for i, (seq, n) in enumerate(items):
            toks = seq.tokens
            start = seq.num_computed
            pos = np.arange(start, start + n)
            tokens[t:t + n] = toks[start:start + n]
            positions[t:t + n] = pos
            pg = np.asarray(seq.pages, np.int64)
            slots[t:t + n] = pg[pos // S] * S + pos % S
            cu[i + 1] = cu[i] + n
            kv_lens[i] = start + n
            pages[i, :len(seq.pages)] = seq.pages
            t += n
            if start + n == len(toks):  # the last pending token: sample after it
                row = row_start + i * row_stride
                logits_index[row] = t - 1
                set_row(row, seq)
                rows.append((seq, row))
        cu[len(items) + 1:] = cu[len(items)]
        return Region(cu, kv_lens, pages, len(items))

    split = layout.n_dec * layout.q_dec
    dec = pre = tree = None
    if layout.n_dec:
        dec = region(layout.n_dec, [(s, 1) for s in decode], 0, 0, layout.q_dec)
    if drafts is not None:
        dec, tree = _draft_region(layout, dec, decode, drafts, tokens, positions, slots,
                                  logits_index, S)
    if layout.n_pre:
        pre = region(layout.n_pre, prefill, split, split)
    return StepBatch(layout, tokens, positions, slots, logits_index, temperature, top_p, top_k,
                     seeds, gen_index, dec, pre, tree, tuple(rows))


def _draft_region(layout: Layout, dec: Region, decode, drafts, tokens, positions, slots,
                  logits_index, S: int) -> tuple[Region, DraftTree]:
    """Re-lay the decode region as [pending token, draft nodes...] per sequence."""
    from seer_jax.engine.speculation import verify_parents

    q = layout.q_dec
    n_nodes = q - 1
    cu = np.zeros(layout.n_dec + 1, np.int32)
    kv_lens = dec.kv_lens
    parents = np.full(layout.n_dec * q, -1, np.int32)
    d_tokens = np.zeros((layout.n_dec, n_nodes), np.int32)
    d_parents = np.full((layout.n_dec, n_nodes), -1, np.int32)
    num_draft = np.zeros(layout.n_dec, np.int32)
    t = 0
    for i, (seq, d) in enumerate(zip(decode, drafts, strict=True)):
        n = len(d)
        root = seq.num_computed
        tokens[t] = seq.tokens[-1]
        tokens[t + 1:t + 1 + n] = d.tokens
        positions[t] = root
        positions[t + 1:t + 1 + n] = root + d.depths()
        pos = root + np.arange(n + 1)
        pg = np.asarray(seq.pages, np.int64)
        slots[t:t + 1 + n] = pg[pos // S] * S + pos % S
        parents[t:t + 1 + n] = verify_parents(d)
        logits_index[i * q:i * q + 1 + n] = np.arange(t, t + 1 + n)
        kv_lens[i] = root + 1 + n
        cu[i + 1] = cu[i] + 1 + n
        d_tokens[i, :n] = d.tokens
        d_parents[i, :n] = d.parents
        num_draft[i] = n
        t += 1 + n
    cu[len(decode) + 1:] = cu[len(decode)]
    slots[t:layout.n_dec * q] = -1
    return (Region(cu, kv_lens, dec.pages, dec.num),
            DraftTree(parents, d_tokens, d_parents, num_draft))
