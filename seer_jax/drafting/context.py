"""Group draft context: the tokens a request's siblings (and the request itself) wrote, indexed for
drafting.

One `GroupDraftContext` per group. In `group` mode a single suffix automaton holds the prompt and
every response of the group (each response continues the prompt); in `per_request` mode each
request has its own automaton over its prompt and its own output (the baseline: classic
per-request suffix decoding). Drafting = find the longest suffix of the request's text that was
ever followed by a token, then follow the most frequent continuations (`draft.build_draft`).

With the defaults, group mode also keeps each request's own automaton (own_context) and drafts
from several match lengths in both (match_candidates); chains take the candidate with the highest
expected accepted length, trees merge all candidates (merge_trees); step probabilities carry a
pseudo-count (prior). Per-request mode gets the same knobs over its own automaton.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal

from seer_jax.drafting.draft import Draft, build_draft, merge_drafts
from seer_jax.drafting.suffix_automaton import SuffixAutomaton
from seer_jax.errors import ConfigError, InputError

DraftMode = Literal["group", "per_request"]
DRAFT_MODES = ("group", "per_request")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """How drafts are made.

    mode: "group" (prompt + all responses of the group) or "per_request" (prompt + own output).
    max_match_len: longest context suffix matched (and kept while a draft path grows).
    min_match_len: no draft when the longest usable match is shorter.
    min_prob: a draft path stops when its probability (product of frequency ratios) drops below.
    max_spec_factor / max_spec_offset: when factor is set, draft depth ≤ factor·match_len + offset
      (SuffixDecoding's cap: short matches give short drafts). None = no cap.
    match_candidates: 1 = draft from the longest matching suffix only; k > 1 = also try the next
      k - 1 shorter suffixes that have different continuation statistics (suffix-link ancestors)
      and keep the draft with the highest expected accepted length (Σ of its path
      probabilities), like SuffixDecoding's best-score selection.
    own_context: group mode only: also index each request's own text (prompt + own output) in an
      automaton of its own and draft from whichever context scores best, the group's or the
      request's (the same best-score selection; own statistics are not diluted by siblings).
    prior: pseudo-count added to every context's continuation total, so a step's probability is
      count / (total + prior): a continuation seen once is trusted less than one seen often.
      0 = plain frequency ratios.
    merge_trees: trees (width > 1) are the union of every candidate's tree (own and group
      contexts, all match candidates), keeping the max_nodes most probable nodes, instead of the
      best-scoring candidate alone.
    """

    mode: DraftMode = "group"
    max_match_len: int = 64
    min_match_len: int = 1
    min_prob: float = 0.05
    max_spec_factor: float | None = None
    max_spec_offset: float = 0.0
    match_candidates: int = 3
    own_context: bool = True
    prior: float = 0.5
    merge_trees: bool = True

    def validate(self) -> DraftConfig:
        if self.mode not in DRAFT_MODES:
            raise ConfigError(f"drafting.mode={self.mode!r} is invalid: must be one of {DRAFT_MODES}")
        if self.max_match_len < 1:
            raise ConfigError(f"drafting.max_match_len={self.max_match_len} must be >= 1")
        if not 0 <= self.min_match_len <= self.max_match_len:
            raise ConfigError(
                f"drafting.min_match_len={self.min_match_len} must be in [0, max_match_len="
                f"{self.max_match_len}]"
            )
        if not 0.0 <= self.min_prob <= 1.0:
            raise ConfigError(f"drafting.min_prob={self.min_prob} must be in [0, 1]")
        if self.match_candidates < 1:
            raise ConfigError(f"drafting.match_candidates={self.match_candidates} must be >= 1")
        if self.max_spec_factor is not None and not self.max_spec_factor >= 0:
            raise ConfigError(f"drafting.max_spec_factor={self.max_spec_factor} must be >= 0 or None")
        if not self.prior >= 0:
            raise ConfigError(f"drafting.prior={self.prior} must be >= 0")
        return self


class GroupDraftContext:
    """The draft context of one group (see module docstring).

    `set_prompt` first (or pass `prompt_ids`), then `append(request_id, tokens)` as tokens are
    generated, in any interleaving across requests; `speculate(request_id, ...)` any time.
    """

    def __init__(self, config: DraftConfig | None = None, prompt_ids: Iterable[int] = ()) -> None:
        self.config = (config or DraftConfig()).validate()
        self._count_depth = self.config.max_match_len + 1
        self._prompt: list[int] = []
        self._requests: dict[str, int] = {}  # request -> sequence id (group mode)
        self._own: dict[str, SuffixAutomaton] = {}  # request -> automaton (per_request mode)
        self._sam: SuffixAutomaton | None = None
        if self.config.mode == "group":
            self._sam = SuffixAutomaton(self._count_depth)
            self._sam.add_sequence()  # sequence 0: the prompt
        self._started = False
        prompt = list(prompt_ids)
        if prompt:
            self.set_prompt(prompt)

    # -- building --------------------------------------------------------------------------------

    @property
    def mode(self) -> DraftMode:
        return self.config.mode

    @property
    def prompt_ids(self) -> list[int]:
        return list(self._prompt)

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests if self._sam is not None else self._own)

    def set_prompt(self, prompt_ids: Iterable[int]) -> None:
        """Append to the group's prompt; only before any response token arrived."""
        toks = [int(t) for t in prompt_ids]
        if self._started:
            raise InputError("the group's prompt cannot change after responses started")
        self._prompt.extend(toks)
        if self._sam is not None:
            self._sam.extend(0, toks)

    def start_request(self, request_id: str) -> None:
        """Register a request (done implicitly by its first `append`)."""
        self._started = True
        if self._sam is not None and request_id not in self._requests:
            self._requests[request_id] = self._sam.add_sequence(fork_from=0)
        if self._keeps_own() and request_id not in self._own:
            sam = SuffixAutomaton(self._count_depth)
            sam.add_sequence()
            sam.extend(0, self._prompt)
            self._own[request_id] = sam

    def _keeps_own(self) -> bool:
        return self._sam is None or self.config.own_context

    def append(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Append generated tokens of a request."""
        self.start_request(request_id)
        toks = token_ids if isinstance(token_ids, (list, tuple)) else list(token_ids)
        if self._sam is not None:
            self._sam.extend(self._requests[request_id], toks)
        own = self._own.get(request_id)
        if own is not None:
            own.extend(0, toks)

    def finish_request(self, request_id: str) -> None:
        """The request will not be drafted for again. Group mode keeps its tokens (its siblings
        still draft from them); its own automaton (per-request mode, own_context) is freed."""
        self._own.pop(request_id, None)

    # -- queries ---------------------------------------------------------------------------------

    def _contexts(self, request_id: str) -> list[tuple[SuffixAutomaton, int]]:
        """(automaton, sequence) pairs the request drafts from: the group's, then its own."""
        if request_id not in (self._requests if self._sam is not None else self._own):
            self.start_request(request_id)
        out = []
        if self._sam is not None:
            out.append((self._sam, self._requests[request_id]))
        own = self._own.get(request_id)
        if own is not None:
            out.append((own, 0))
        return out

    def speculate(
        self,
        request_id: str,
        max_nodes: int = 8,
        max_depth: int = 8,
        width: int = 1,
        min_prob: float | None = None,
    ) -> Draft:
        """Draft continuations of the request's text (prompt + its tokens appended so far).

        width 1 gives a chain of ≤ min(max_nodes, max_depth) tokens; width k > 1 a tree keeping the
        top k continuations at forks, ≤ max_nodes nodes, paths ≤ max_depth tokens.
        """
        cap = self.config.max_match_len
        cands = []
        for sam, seq in self._contexts(request_id):
            state, length = sam.suffix_state(seq, cap)
            cands += self._candidates(sam, state, length, max_nodes, max_depth, width, min_prob)
        return self._combine(cands, max_nodes, width)

    def speculate_pattern(
        self,
        pattern: Sequence[int],
        request_id: str | None = None,
        max_nodes: int = 8,
        max_depth: int = 8,
        width: int = 1,
        min_prob: float | None = None,
    ) -> Draft:
        """Like `speculate`, for an explicit context `pattern` (its last max_match_len tokens
        are matched). In per-request mode `request_id` selects the automaton (with own_context,
        it adds the request's own one)."""
        if self._sam is None and request_id is None:
            raise InputError("per_request mode needs a request_id to draft from")
        if self._sam is None:
            sams = [self._contexts(request_id)[0][0]]
        else:
            sams = [self._sam] + ([self._own[request_id]] if request_id in self._own else [])
        cap = self.config.max_match_len
        cands = []
        for sam in sams:
            state, length = sam.match(pattern[-cap:], cap)
            cands += self._candidates(sam, state, length, max_nodes, max_depth, width, min_prob)
        return self._combine(cands, max_nodes, width)

    def _combine(self, cands: list[tuple[Draft, float]], max_nodes: int, width: int) -> Draft:
        """The best-scoring candidate; trees (width > 1) with merge_trees: all candidates merged
        into one tree of the most probable nodes."""
        if not cands:
            return Draft.empty()
        if width > 1 and self.config.merge_trees and len(cands) > 1:
            return merge_drafts([d for d, _ in cands], max_nodes)
        return max(cands, key=lambda c: c[1])[0]

    def _candidates(self, sam, state, length, max_nodes, max_depth, width,
                    min_prob) -> list[tuple[Draft, float]]:
        """Drafts from the match candidates of one automaton (the longest match with a
        continuation, then up to match_candidates - 1 shorter ones), each with its score: the
        expected accepted length Σ path probabilities. [(empty, 0)] when there is a match but no
        draft, [] when the context has no usable match."""
        cfg = self.config
        state, length = sam.with_continuation(state, length)
        if length < cfg.min_match_len or not sam.children(state):
            return []
        min_prob = cfg.min_prob if min_prob is None else min_prob
        out = []
        for _ in range(cfg.match_candidates):
            depth = max_depth
            if cfg.max_spec_factor is not None:
                depth = min(depth, math.floor(cfg.max_spec_factor * length + cfg.max_spec_offset))
            d = build_draft(sam, state, length, max_nodes=max_nodes, max_depth=depth,
                            width=width, min_prob=min_prob, context_cap=cfg.max_match_len,
                            prior=cfg.prior)
            out.append((d, float(d.probs.sum()) if len(d) else 0.0))
            if not state:
                break
            state = sam.state_link(state)  # next shorter context with other statistics
            state, length = sam.with_continuation(state, sam.state_length(state))
            if length < cfg.min_match_len or not state:
                break
        return out

    # -- stats -----------------------------------------------------------------------------------

    def num_tokens(self) -> int:
        """Positions indexed (group mode: prompt once + every response)."""
        own = sum(s.num_tokens for s in self._own.values())
        return own + (self._sam.num_tokens if self._sam is not None else 0)

    def num_states(self) -> int:
        own = sum(s.num_states for s in self._own.values())
        return own + (self._sam.num_states if self._sam is not None else 0)

