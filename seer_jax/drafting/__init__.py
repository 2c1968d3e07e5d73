"""Model-free drafting for speculative decoding: group suffix contexts, the draft service and the
adaptive speculation budget.

Engine flow per step (B running requests):

    plan = budget.plan(B)                         # γ*, on/off, tree width (call once per step)
    if plan.enabled:
        drafts = service.speculate([DraftQuery(g, r, plan.max_nodes_per_request, plan.max_depth,
                                               plan.width) for g, r in running])
        drafts = budget.allocate(drafts, priorities, plan)   # Γ nodes by marginal benefit
    ... verify (tokens + parents per request), commit accepted tokens ...
    service.append_batch([DraftAppend.make(g, r, new_tokens) ...])
    budget.stats.observe_drafts(drafts, accepted_counts)

A draft is `Draft(tokens int32[n], parents int32[n] (-1 = the last committed token, parents[i] <
i), probs float32[n] (path probabilities), match_len)`.
"""

from seer_jax.drafting.budget import (
    AcceptanceStats,
    BudgetConfig,
    BudgetPlan,
    SpeculationBudget,
)
from seer_jax.drafting.context import DRAFT_MODES, DraftConfig, GroupDraftContext
from seer_jax.drafting.draft import Draft, build_draft, merge_drafts
from seer_jax.drafting.service import (
    DraftAppend,
    DraftQuery,
    DraftReplica,
    DraftService,
    GroupUpdate,
    InProcessDraftService,
)
from seer_jax.drafting.suffix_automaton import SuffixAutomaton

__all__ = [
    "AcceptanceStats",
    "BudgetConfig",
    "BudgetPlan",
    "SpeculationBudget",
    "DRAFT_MODES",
    "Draft",
    "DraftAppend",
    "DraftConfig",
    "DraftQuery",
    "DraftReplica",
    "DraftService",
    "GroupUpdate",
    "InProcessDraftService",
    "GroupDraftContext",
    "SuffixAutomaton",
    "build_draft",
    "merge_drafts",
]
