"""Replay study: how many draft tokens would be accepted if a group's recorded responses were being
generated concurrently.

Every group's G responses advance one token per step in lock-step (optionally with staggered
starts). At each step, each active request first gets a draft from its drafter (which has seen the
prompt and every token generated so far, by itself and, in group modes, its siblings), the draft is
checked against the recorded continuation (tree: longest matching root-to-node path), then every
active request appends its next token. Recorded responses play the target model; acceptance is
exact match (greedy verification).

Rollout file format (JSON lines, one group per line):
  {"group_id": "g0", "prompt_ids": [...], "responses": [[...], [...], ...]}
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from seer_jax.drafting.context import DraftConfig, GroupDraftContext
from seer_jax.drafting.draft import Draft
from seer_jax.errors import InputError

RATES = (0.1, 0.2, 0.3, 0.5)  # speculation rates of `ReplayStats.accepted_per_spec_at_rates`


@dataclasses.dataclass
class GroupRollout:
    group_id: str
    prompt_ids: list[int]
    responses: list[list[int]]


def _records(path: str | pathlib.Path, what: str, keys: str, parse) -> list[GroupRollout]:
    """`parse(record, line_index)` over the non-empty JSON lines of `path`; an InputError names
    the file and line of a bad record (`keys`: what a record must hold) or an empty file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"{what} file not found: {path}")
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            out.append(parse(json.loads(line), i))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}:{i + 1}: expected {keys}: {e}") from None
    if not out:
        raise InputError(f"{what} file {path} has no groups")
    return out


def load_rollouts_jsonl(path: str | pathlib.Path) -> list[GroupRollout]:
    return _records(path, "rollouts", "{'group_id', 'prompt_ids', 'responses'}", lambda d, i: GroupRollout(
        group_id=str(d.get("group_id", i)),
        prompt_ids=[int(t) for t in d["prompt_ids"]],
        responses=[[int(t) for t in r] for r in d["responses"]],
    ))


def load_texts_jsonl(path: str | pathlib.Path, tokenizer,
                     max_tokens_per_response: int = 0) -> list[GroupRollout]:
    """Group rollouts from response texts, one group per line: {"prompt_id", "prompt",
    "responses": [str, ...]} (extra keys ignored). The prompt is rendered as a one-turn chat and
    every response tokenized with `tokenizer` (no BOS); `max_tokens_per_response` > 0 keeps only
    that many leading tokens of each response."""
    if max_tokens_per_response < 0:
        raise InputError(f"max_tokens_per_response={max_tokens_per_response} must be >= 0")

    def parse(d, i):
        prompt, texts = str(d["prompt"]), [str(r) for r in d["responses"]]
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        responses = tokenizer.encode_batch(texts, add_bos=False)
        if max_tokens_per_response:
            responses = [r[:max_tokens_per_response] for r in responses]
        return GroupRollout(str(d.get("prompt_id", i)), [int(t) for t in prompt_ids],
                            [[int(t) for t in r] for r in responses if r])

    return _records(path, "texts", "{'prompt', 'responses'}", parse)


def save_rollouts_jsonl(path: str | pathlib.Path, groups: Sequence[GroupRollout]) -> None:
    with open(path, "w") as f:
        for g in groups:
            f.write(json.dumps(dataclasses.asdict(g)) + "\n")


class GroupDrafter(Protocol):
    """What the replay drives: one instance per group."""

    def append(self, request: int, token: int) -> None: ...

    def speculate(self, request: int, context: list[int]) -> Draft: ...


@dataclasses.dataclass
class OursDrafter:
    """Our group draft context as a replay drafter."""

    ctx: GroupDraftContext
    max_nodes: int
    max_depth: int
    width: int

    @classmethod
    def factory(cls, config: DraftConfig, max_nodes: int = 8, max_depth: int = 8,
                width: int = 1) -> Callable[[GroupRollout], OursDrafter]:
        def make(group: GroupRollout) -> OursDrafter:
            ctx = GroupDraftContext(config, group.prompt_ids)
            for i in range(len(group.responses)):
                ctx.start_request(str(i))
            return cls(ctx, max_nodes, max_depth, width)

        return make

    def append(self, request: int, token: int) -> None:
        self.ctx.append(str(request), (token,))

    def speculate(self, request: int, context: list[int]) -> Draft:
        return self.ctx.speculate(str(request), self.max_nodes, self.max_depth, self.width)


class ArcticDrafter:
    """arctic-inference's SuffixDecodingCache as a peer. `siblings=True`: one cache per group, every
    request's active response in its global tree; False: the request's prompt + own output only."""

    def __init__(self, group: GroupRollout, siblings: bool, max_spec_tokens: int = 8,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_tree_depth: int = 64, tree: bool = False) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self._kw = dict(max_spec_tokens=max_spec_tokens, max_spec_factor=max_spec_factor,
                        min_token_prob=min_token_prob, use_tree_spec=tree)
        self._depth = max_tree_depth
        n = len(group.responses)
        prompt = np.asarray(group.prompt_ids, np.int32)
        if siblings:
            cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=-1)
            self._caches = [cache] * n
        else:
            self._caches = [SuffixDecodingCache(max_tree_depth=max_tree_depth,
                                                max_cached_requests=0) for _ in range(n)]
        for i, c in enumerate(self._caches):
            c.start_request(i, prompt)

    @staticmethod
    def available() -> bool:
        try:
            import arctic_inference.suffix_decoding  # noqa: F401
        except Exception:
            return False
        return True

    def append(self, request: int, token: int) -> None:
        self._caches[request].add_active_response(request, [token])

    def speculate(self, request: int, context: list[int]) -> Draft:
        ctx = np.asarray(context[-self._depth :], np.int32)
        d = self._caches[request].speculate(request, ctx, **self._kw)
        if not d.token_ids:
            return Draft.empty(d.match_len)
        return Draft(np.asarray(d.token_ids, np.int32), np.asarray(d.parents, np.int32),
                     np.asarray(d.probs, np.float32), int(d.match_len))


class CopyOracleDrafter:
    """A bound, not a drafter: it knows each request's recorded continuation and drafts the
    longest prefix of it (at most `depth` tokens) that its context holds right after an occurrence
    of the request's last `match_len` tokens (anywhere when 0). That is what a copy-based drafter
    (suffix tree, automaton, n-gram cache) could get accepted at that step if it picked the best
    occurrence in hindsight. `siblings=False`: the context is the prompt and the request's own
    output; True: the prompt and every response of the group so far (its own included)."""

    def __init__(self, group: GroupRollout, siblings: bool, depth: int = 8,
                 match_len: int = 1) -> None:
        if depth < 1 or match_len < 0:
            raise InputError(f"copy bound needs depth >= 1 and match_len >= 0, got {depth}, "
                             f"{match_len}")
        self._resp = group.responses
        self._prompt_len = len(group.prompt_ids)
        self._depth, self._match = depth, match_len
        self._n = match_len + depth  # longest n-gram a query asks about
        prompt = list(group.prompt_ids)
        base: set[tuple[int, ...]] = set()
        for end in range(1, len(prompt) + 1):
            self._add(base, prompt, end)
        n = len(group.responses)
        self._seqs = [list(prompt) for _ in range(n)]
        self._sets = [base] * n if siblings else [set(base) for _ in range(n)]

    def _add(self, grams: set, seq: list[int], end: int) -> None:
        """The n-grams of `seq` that end at position end - 1, n = 1 .. match_len + depth."""
        for k in range(1, min(self._n, end) + 1):
            grams.add(tuple(seq[end - k : end]))

    def append(self, request: int, token: int) -> None:
        seq = self._seqs[request]
        seq.append(token)
        self._add(self._sets[request], seq, len(seq))

    def speculate(self, request: int, context: list[int]) -> Draft:
        grams = self._sets[request]
        pos = len(context) - self._prompt_len
        future = self._resp[request][pos : pos + self._depth]
        head = tuple(context[len(context) - self._match :]) if self._match else ()
        k = 0
        while k < len(future) and head + tuple(future[: k + 1]) in grams:
            k += 1
        return Draft.chain(future[:k]) if k else Draft.empty()


@dataclasses.dataclass
class ReplayStats:
    steps: int = 0  # (request, step) events
    specs: int = 0  # events with a non-empty draft
    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    spec_seconds: float = 0.0
    append_seconds: float = 0.0
    accepted_by_phase: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])
    steps_by_phase: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0, 0])
    # per step: the draft's score (expected accepted length, Σ path probabilities; 0 without a
    # draft) and the draft tokens accepted
    scores: list[float] = dataclasses.field(default_factory=list)
    accepts: list[int] = dataclasses.field(default_factory=list)
    # per step: the draft's depth (0 without a draft) and how many of the request's siblings had
    # finished their responses (the calibration of `seer_jax.drafting.calibration`)
    depths: list[int] = dataclasses.field(default_factory=list)
    finished: list[int] = dataclasses.field(default_factory=list)

    def accepted_per_spec_at_rates(self, rates: Sequence[float] = RATES) -> dict[str, float | None]:
        """Accepted draft tokens per speculation had the drafter speculated only on the `rate`
        share of steps where its own score was highest (ties: earlier steps first). Accepted per
        speculation alone rewards drafting less often; at one rate two drafters are compared on
        equal terms. None where the drafter drafted on fewer steps than the rate asks for."""
        order = np.argsort(-np.asarray(self.scores, np.float64), kind="stable")
        acc = np.asarray(self.accepts, np.float64)[order]
        out: dict[str, float | None] = {}
        for r in rates:
            k = int(round(r * len(order)))
            out[f"{r:g}"] = float(acc[:k].mean()) if 0 < k <= self.specs else None
        return out

    def summary(self) -> dict:
        s = max(self.specs, 1)
        return {
            "accepted_per_spec": self.accepted / s,
            "accepted_per_step": (self.accepted + self.steps) / max(self.steps, 1),
            "draft_tokens_per_spec": self.proposed / s,
            "acceptance_rate": self.accepted / max(self.proposed, 1),
            "spec_fraction": self.specs / max(self.steps, 1),
            "steps": self.steps,
            "specs": self.specs,
            "us_per_speculate": 1e6 * self.spec_seconds / max(self.steps, 1),
            "us_per_append": 1e6 * self.append_seconds / max(self.steps, 1),
            # tokens per step by quarter of each response (the tail is the last one)
            "accepted_per_step_by_quarter": [
                (a + n) / max(n, 1)
                for a, n in zip(self.accepted_by_phase, self.steps_by_phase, strict=True)
            ],
            "accepted_per_spec_at_rate": self.accepted_per_spec_at_rates(),
        }


def replay_group(group: GroupRollout, drafter: GroupDrafter, stats: ReplayStats,
                 stagger: Sequence[int] | None = None) -> None:
    """Replay one group's responses in lock-step (request i starts at step stagger[i])."""
    resp = group.responses
    n = len(resp)
    start = list(stagger) if stagger is not None else [0] * n
    end = [start[i] + len(resp[i]) for i in range(n)]
    contexts = [list(group.prompt_ids) for _ in range(n)]
    clock = time.perf_counter
    for t in range(min(start), max(end) if end else 0):
        active = [i for i in range(n) if start[i] <= t < end[i]]
        done = sum(1 for e in end if e <= t)  # finished responses (none of them active)
        t0 = clock()
        drafts = [drafter.speculate(i, contexts[i]) for i in active]
        t1 = clock()
        for i, d in zip(active, drafts, strict=True):
            pos = t - start[i]
            acc = d.accepted_length(resp[i][pos : pos + 64]) if len(d) else 0
            phase = min(4 * pos // max(len(resp[i]), 1), 3)
            stats.steps += 1
            stats.steps_by_phase[phase] += 1
            stats.scores.append(float(d.probs.sum()) if len(d) else 0.0)
            stats.accepts.append(acc)
            stats.depths.append(d.depth if len(d) else 0)
            stats.finished.append(done)
            if len(d):
                stats.specs += 1
                stats.proposed += len(d)
                stats.accepted += acc
                stats.accepted_by_phase[phase] += acc
        t2 = clock()
        for i in active:
            tok = resp[i][t - start[i]]
            drafter.append(i, tok)
            contexts[i].append(tok)
        stats.spec_seconds += t1 - t0
        stats.append_seconds += clock() - t2


def replay(groups: Sequence[GroupRollout], make_drafter: Callable[[GroupRollout], GroupDrafter],
           stagger: int = 0, seed: int = 0) -> ReplayStats:
    """Replay every group with a fresh drafter; stagger > 0 draws each request's start step
    uniformly from [0, stagger]."""
    rng = np.random.default_rng(seed)
    stats = ReplayStats()
    for g in groups:
        offs = (rng.integers(0, stagger + 1, size=len(g.responses)).tolist() if stagger > 0
                else None)
        replay_group(g, make_drafter(g), stats, offs)
    return stats


def simulate_tail(groups: Sequence[GroupRollout], budget, config: DraftConfig | None = None,
                  tail_fraction: float = 0.25) -> dict:
    """Model the tail of a rollout: every response has generated all but its last `tail_fraction`
    (its group context holds the prompt and those prefixes of all siblings); all requests of all
    groups then decode together in one batch that shrinks as responses end.

    Plain decoding advances each request one token per step. Speculative decoding plans each
    step with `budget` (a `SpeculationBudget`: γ*, on/off, tree width, marginal-benefit
    allocation), drafts from the group contexts, accepts the longest draft path matching the
    recorded continuation (+1 bonus token) and feeds the outcome back into the budget's online
    acceptance rates. Step time is `budget.step_time(B, mean draft tokens per request)`.
    """
    config = config or DraftConfig()
    ctxs, reqs = [], []  # reqs: (group index, request id, response, position)
    for gi, g in enumerate(groups):
        ctx = GroupDraftContext(config, g.prompt_ids)
        starts = [int(len(r) * (1.0 - tail_fraction)) for r in g.responses]
        for i in range(len(g.responses)):
            ctx.start_request(str(i))
        for t in range(max(starts, default=0)):  # lock-step history
            for i, r in enumerate(g.responses):
                if t < starts[i]:
                    ctx.append(str(i), (r[t],))
        ctxs.append(ctx)
        reqs.extend((gi, str(i), r, starts[i]) for i, r in enumerate(g.responses)
                    if starts[i] < len(r))
    remaining = sorted(len(r) - p for _, _, r, p in reqs)
    # plain decoding: B(t) = number of requests with more than t tokens left
    time_plain, steps_plain = 0.0, remaining[-1] if remaining else 0
    k = 0
    for t in range(steps_plain):
        while k < len(remaining) and remaining[k] <= t:
            k += 1
        time_plain += budget.step_time(len(remaining) - k, 0)

    pos = [p for _, _, _, p in reqs]
    active = list(range(len(reqs)))
    time_spec, steps_spec, specs, accepted_total, drafted = 0.0, 0, 0, 0, 0
    while active:
        b = len(active)
        plan = budget.plan(b)
        drafts = []
        if plan.enabled:
            cand = [ctxs[reqs[j][0]].speculate(reqs[j][1], plan.max_nodes_per_request,
                                               plan.max_depth, plan.width) for j in active]
            drafts = budget.allocate(cand, None, plan)
        n_draft = sum(len(d) for d in drafts)
        time_spec += budget.step_time(b, n_draft / b)
        steps_spec += 1
        drafted += n_draft
        still = []
        accepted_now = []
        for idx, j in enumerate(active):
            gi, rid, resp, p = reqs[j][0], reqs[j][1], reqs[j][2], pos[j]
            acc = 0
            if drafts and len(drafts[idx]):
                acc = min(drafts[idx].accepted_length(resp[p : p + 64]), len(resp) - p - 1)
                specs += 1
                accepted_total += acc
            accepted_now.append(acc)
            adv = acc + 1
            ctxs[gi].append(rid, resp[p : p + adv])
            pos[j] = p + adv
            if pos[j] < len(resp):
                still.append(j)
        if drafts:
            budget.stats.observe_drafts(drafts, accepted_now)
        active = still
    return {
        "requests": len(reqs),
        "steps_plain": steps_plain,
        "steps_spec": steps_spec,
        "time_plain_s": time_plain,
        "time_spec_s": time_spec,
        "tail_speedup": time_plain / time_spec if time_spec > 0 else 1.0,
        "steps_ratio_vs_plain": steps_spec / max(steps_plain, 1),
        "accepted_per_spec": accepted_total / max(specs, 1),
        "draft_tokens_per_step": drafted / max(steps_spec, 1),
        "beta": budget.stats.beta.tolist(),
    }
