"""Model-free drafting for speculative decoding: group suffix contexts, the draft service and the
adaptive speculation budget."""

from seer_jax.rollout.drafting.budget import (
    AcceptanceStats,
    BudgetConfig,
    BudgetPlan,
    SpeculationBudget,
)
from seer_jax.rollout.drafting.context import DRAFT_MODES, DraftConfig, GroupDraftContext
from seer_jax.rollout.drafting.draft import Draft, build_draft
from seer_jax.rollout.drafting.service import (
    DraftAppend,
    DraftQuery,
    DraftReplica,
    DraftService,
    GroupUpdate,
    InProcessDraftService,
)
from seer_jax.rollout.drafting.suffix_automaton import SuffixAutomaton

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
]
