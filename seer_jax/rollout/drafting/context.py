"""Group draft context: the tokens a request's siblings (and the request itself) wrote, indexed for
drafting.

One `GroupDraftContext` per group. In `group` mode a single suffix automaton holds the prompt and
every response of the group (each response continues the prompt); in `per_request` mode each
request has its own automaton over its prompt and its own output (the baseline: classic
per-request suffix decoding). Drafting = find the longest suffix of the request's text that was
ever followed by a token, then follow the most frequent continuations (`draft.build_draft`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal

from seer_jax.errors import ConfigError, InputError
from seer_jax.rollout.drafting.draft import Draft, build_draft
from seer_jax.rollout.drafting.suffix_automaton import SuffixAutomaton

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
    """

    mode: DraftMode = "group"
    max_match_len: int = 64
    min_match_len: int = 1
    min_prob: float = 0.1
    max_spec_factor: float | None = None
    max_spec_offset: float = 0.0
    match_candidates: int = 1

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
        if self._sam is not None:
            if request_id not in self._requests:
                self._requests[request_id] = self._sam.add_sequence(fork_from=0)
        elif request_id not in self._own:
            sam = SuffixAutomaton(self._count_depth)
            sam.add_sequence()
            sam.extend(0, self._prompt)
            self._own[request_id] = sam

    def append(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Append generated tokens of a request."""
        self.start_request(request_id)
        if self._sam is not None:
            self._sam.extend(self._requests[request_id], token_ids)
        else:
            self._own[request_id].extend(0, token_ids)

    def finish_request(self, request_id: str) -> None:
        """The request will not be drafted for again. Group mode keeps its tokens (its siblings
        still draft from them); per-request mode frees its automaton."""
        self._own.pop(request_id, None)

    # -- queries ---------------------------------------------------------------------------------

    def _automaton(self, request_id: str) -> tuple[SuffixAutomaton, int]:
        if self._sam is not None:
            seq = self._requests.get(request_id)
            if seq is None:
                self.start_request(request_id)
                seq = self._requests[request_id]
            return self._sam, seq
        sam = self._own.get(request_id)
        if sam is None:
            self.start_request(request_id)
            sam = self._own[request_id]
        return sam, 0

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
        sam, seq = self._automaton(request_id)
        state, length = sam.suffix_state(seq, self.config.max_match_len)
        return self._draft(sam, state, length, max_nodes, max_depth, width, min_prob)

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
        are matched). In per-request mode `request_id` selects the automaton."""
        if self._sam is not None:
            sam = self._sam
        else:
            if request_id is None:
                raise InputError("per_request mode needs a request_id to draft from")
            sam, _ = self._automaton(request_id)
        cap = self.config.max_match_len
        state, length = sam.match(pattern[-cap:], cap)
        return self._draft(sam, state, length, max_nodes, max_depth, width, min_prob)

    def _draft(self, sam, state, length, max_nodes, max_depth, width, min_prob) -> Draft:
        cfg = self.config
        state, length = sam.with_continuation(state, length)
        if length < cfg.min_match_len or not sam.children(state):
            return Draft.empty(length)
        min_prob = cfg.min_prob if min_prob is None else min_prob
        best: Draft | None = None
        best_score = -1.0
        for _ in range(cfg.match_candidates):
            depth = max_depth
            if cfg.max_spec_factor is not None:
                depth = min(depth, math.floor(cfg.max_spec_factor * length + cfg.max_spec_offset))
            d = build_draft(sam, state, length, max_nodes=max_nodes, max_depth=depth,
                            width=width, min_prob=min_prob, context_cap=cfg.max_match_len)
            score = float(d.probs.sum()) if len(d) else 0.0
            if score > best_score:
                best, best_score = d, score
            if not state:
                break
            state = sam.state_link(state)  # next shorter context with other statistics
            state, length = sam.with_continuation(state, sam.state_length(state))
            if length < cfg.min_match_len or not state:
                break
        return best

    # -- stats -----------------------------------------------------------------------------------

    def num_tokens(self) -> int:
        """Positions indexed (group mode: prompt once + every response)."""
        if self._sam is not None:
            return self._sam.num_tokens
        return sum(s.num_tokens for s in self._own.values())

    def num_states(self) -> int:
        if self._sam is not None:
            return self._sam.num_states
        return sum(s.num_states for s in self._own.values())

