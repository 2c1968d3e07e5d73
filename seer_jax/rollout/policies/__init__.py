"""Scheduling policies, one module each, and their registry.

`make_policy(name)` builds one; `POLICIES` lists the names. See `base.Policy` for the interface.
"""

from __future__ import annotations

from seer_jax.errors import ConfigError
from seer_jax.rollout.policies.base import GroupState, Policy, RequestState
from seer_jax.rollout.policies.group_round_robin import GroupRoundRobinPolicy
from seer_jax.rollout.policies.oracle_group_lfs import OracleGroupLFSPolicy
from seer_jax.rollout.policies.oracle_lfs import OracleLFSPolicy
from seer_jax.rollout.policies.request_fcfs import RequestFCFSPolicy
from seer_jax.rollout.policies.seer import SeerPolicy
from seer_jax.rollout.policies.seer_prompt_oracle import SeerPromptOraclePolicy
from seer_jax.rollout.policies.seer_running_oracle import SeerRunningOraclePolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (SeerPolicy, GroupRoundRobinPolicy, RequestFCFSPolicy, OracleLFSPolicy,
                OracleGroupLFSPolicy, SeerRunningOraclePolicy, SeerPromptOraclePolicy)
}


def make_policy(name: str) -> Policy:
    """A fresh policy object by name; ConfigError for an unknown name."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"policy={name!r} is unknown; allowed: {sorted(POLICIES)}")
    return cls()


__all__ = [
    "POLICIES",
    "GroupRoundRobinPolicy",
    "GroupState",
    "OracleGroupLFSPolicy",
    "OracleLFSPolicy",
    "Policy",
    "RequestFCFSPolicy",
    "RequestState",
    "SeerPolicy",
    "SeerPromptOraclePolicy",
    "SeerRunningOraclePolicy",
    "make_policy",
]
