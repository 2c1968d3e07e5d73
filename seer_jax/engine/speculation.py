"""Grouped speculative decoding inside the engine: drafts from the group draft service, the
adaptive budget, and the bookkeeping after lossless verification.

Every generated token is appended to the draft service (the group's shared context). Each step,
the budget (`SpeculationBudget`, the paper's Alg. 1) decides whether to speculate for the current
decode batch and how many draft nodes each sequence gets; drafts are token trees (parents), which
the engine verifies in one ragged forward (`ModelRunner.verify`) and accepts by rejection
sampling (`seer_jax.model.sampling_acceptance.accept_draft_tree`).
"""

from __future__ import annotations

import numpy as np

from seer_jax.drafting.budget import SpeculationBudget
from seer_jax.drafting.draft import Draft
from seer_jax.drafting.draft_rows import DraftRows
from seer_jax.drafting.service import DraftAppend, DraftQuery, InProcessDraftService


class Speculator:
    def __init__(self, service=None, budget: SpeculationBudget | None = None):
        self.service = service if service is not None else InProcessDraftService()
        self.budget = budget if budget is not None else SpeculationBudget()
        self._prompted: set[str] = set()
        self.proposed = 0
        self.accepted = 0
        self.spec_steps = 0

    def on_add(self, group_id: str, prompt: list[int]) -> None:
        if group_id not in self._prompted:
            version = getattr(self.service, "version", None)
            if version is None or version(group_id) == 0:
                self.service.append(group_id, None, prompt)
            self._prompted.add(group_id)

    def on_tokens(self, group_id: str, request_id: str, tokens: list[int]) -> None:
        if tokens:
            self.service.append(group_id, request_id, tokens)

    def on_finish(self, group_id: str, request_id: str) -> None:
        finish = getattr(self.service, "finish_request", None)
        if finish is not None:
            finish(group_id, request_id)

    def close_group(self, group_id: str) -> None:
        """Every request of the group has finished: its context goes."""
        self._prompted.discard(group_id)
        close = getattr(self.service, "close_group", None)
        if close is not None:
            close(group_id)

    def on_step(self, appended, ended) -> None:
        """A committed step: its tokens [(group, request, tokens)], in one batch of appends to
        the service, then the requests that ended [(group, request)]."""
        rows = [(g, r, t) for g, r, t in appended if len(t)]
        append_rows = getattr(self.service, "append_rows", None)
        if append_rows is not None:  # (an in-process service: no message per row)
            if rows:
                append_rows(rows)
        else:
            # (the engine's tokens are ints already: no validation per message)
            msgs = [DraftAppend(g, r, np.array(t, np.int32)) for g, r, t in rows]
            append_batch = getattr(self.service, "append_batch", None)
            if append_batch is not None:
                if msgs:
                    append_batch(msgs)
            else:
                for m in msgs:
                    self.service.append(m.group_id, m.request_id, m.token_ids)
        for g, r in ended:
            self.on_finish(g, r)

    def wants_drafts(self, num_seqs: int) -> bool:
        """Whether the budget would speculate for `num_seqs` decodes (nothing changes): the
        engine then commits the step in flight before planning, so that drafts can follow
        its tokens."""
        return self.budget.plan(num_seqs, relax=False).enabled

    def skip(self, num_seqs: int) -> None:
        """A decode step planned without drafts (its tokens are still on the device): the
        budget counts it as a step without speculation."""
        self.budget.plan(num_seqs)

    def propose(self, seqs, limits) -> DraftRows | None:
        """Drafts for the decode batch (`DraftRows`, a sequence of `Draft`s), or None when the
        budget turns speculation off. limits[i]: the most draft tokens sequence i may still use
        (tokens left in its budget)."""
        plan = self.budget.plan(len(seqs))
        if not plan.enabled:
            return None
        rows = getattr(self.service, "speculate_rows", None)
        if rows is not None:  # (an in-process service: no query objects)
            drafts = rows([(s.group_id, s.request_id) for s in seqs],
                          plan.max_nodes_per_request, plan.max_depth, plan.width)
        else:
            drafts = self.service.speculate([
                DraftQuery(s.group_id, s.request_id, max_nodes=plan.max_nodes_per_request,
                           max_depth=plan.max_depth, width=plan.width) for s in seqs])
        drafts = self.budget.allocate(drafts, [s.priority for s in seqs], plan)
        lim = np.asarray(limits, np.int64)
        if drafts.num_nodes and (lim < plan.max_depth).any():  # deeper than a request may go
            drafts = drafts.select(drafts.depths <= lim[drafts.row])
        return drafts

    def observe(self, drafts, accepted: list[int], proposed: int | None = None) -> None:
        """A verified step: its drafts (`DraftRows` or `Draft`s), the tokens accepted of each
        (proposed: the drafts' nodes in all, when the caller counted them)."""
        self.budget.stats.observe_drafts(drafts, accepted)
        self.proposed += int(sum(len(d) for d in drafts) if proposed is None else proposed)
        self.accepted += int(sum(accepted))
        self.spec_steps += 1


def verify_parents(draft: Draft) -> np.ndarray:
    """Tree parents over [root, nodes...] relative to the root: root -1, node j -> parent + 1."""
    return np.concatenate([[-1], draft.parents.astype(np.int32) + 1]).astype(np.int32)
