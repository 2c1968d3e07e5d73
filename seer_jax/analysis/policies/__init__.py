"""Analysis-only scheduling policies: oracles that know true lengths, and diagnostic variants of
`seer`. `CATALOG` holds these and the production policies, for benchmarks and comparison runs.
"""

from __future__ import annotations

from seer_jax.analysis.policies.conditional_quantile import OracleConditionalQuantilePolicy
from seer_jax.analysis.policies.first_finish import (
    OracleConditionalMaxPolicy,
    OracleFirstFinishPolicy,
)
from seer_jax.analysis.policies.oracle_group_lfs import OracleGroupLFSPolicy
from seer_jax.analysis.policies.oracle_lfs import OracleLFSPolicy
from seer_jax.analysis.policies.seer_prompt_oracle import SeerPromptOraclePolicy
from seer_jax.analysis.policies.seer_running_oracle import SeerRunningOraclePolicy
from seer_jax.rollout.core.policies import POLICIES, Hindsight, PolicyCatalog

ANALYSIS_POLICIES = {
    cls.name: cls
    for cls in (OracleLFSPolicy, OracleGroupLFSPolicy, OracleFirstFinishPolicy,
                OracleConditionalMaxPolicy, OracleConditionalQuantilePolicy, SeerRunningOraclePolicy,
                SeerPromptOraclePolicy)
}
# policies that need a workload's generating distributions (synthetic simulator workloads only)
NEEDS_DISTRIBUTIONS = (SeerPromptOraclePolicy.name,)

CATALOG = PolicyCatalog(
    {**POLICIES, **ANALYSIS_POLICIES},
    builders={
        OracleLFSPolicy.name: lambda h: OracleLFSPolicy(h.true_lengths),
        OracleGroupLFSPolicy.name: lambda h: OracleGroupLFSPolicy(h.true_lengths),
        OracleFirstFinishPolicy.name: lambda h: OracleFirstFinishPolicy(h.true_lengths),
        OracleConditionalMaxPolicy.name: lambda h: OracleConditionalMaxPolicy(h.true_lengths),
        OracleConditionalQuantilePolicy.name:
            lambda h: OracleConditionalQuantilePolicy(h.true_lengths),
        SeerRunningOraclePolicy.name: lambda h: SeerRunningOraclePolicy(h.true_lengths),
        SeerPromptOraclePolicy.name: lambda h: SeerPromptOraclePolicy(h.length_distributions),
    },
)

__all__ = [
    "ANALYSIS_POLICIES",
    "CATALOG",
    "NEEDS_DISTRIBUTIONS",
    "OracleConditionalMaxPolicy",
    "OracleConditionalQuantilePolicy",
    "OracleFirstFinishPolicy",
    "Hindsight",
    "OracleGroupLFSPolicy",
    "OracleLFSPolicy",
    "SeerPromptOraclePolicy",
    "SeerRunningOraclePolicy",
]
