"""Production scheduling policies, one module each, and their registry.

`make_policy(name)` builds one; `POLICIES` lists the names; `CATALOG` is the `PolicyCatalog` a
run uses unless it is handed another (the analysis catalog adds oracles). See `base.Policy` for
the interface.
"""

from __future__ import annotations

import ml_collections

from seer_jax.rollout.core.policies.base import (
    GroupState,
    Hindsight,
    Policy,
    PolicyCatalog,
    RequestState,
)
from seer_jax.rollout.core.policies.group_round_robin import GroupRoundRobinPolicy
from seer_jax.rollout.core.policies.request_fcfs import RequestFCFSPolicy
from seer_jax.rollout.core.policies.seer import SeerPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SeerPolicy, GroupRoundRobinPolicy, RequestFCFSPolicy)
}
CATALOG = PolicyCatalog(POLICIES)


def default_policy_options() -> ml_collections.ConfigDict:
    """`policy.<name>.*` config: each policy's own options with their defaults.

    seer.estimator: "hedged" (FCFS, except that a request of a mostly finished group whose
        finished responses agree, that has generated over 6x the longest of them, is served
        first), "posterior" (hierarchical log-normal model
        fitted online; a request that outlived its group ranks as unknown), "first_finisher" (FCFS,
        deferring requests of groups whose first response stopped early) or "max_finished"
        (the paper's L_g).
    seer.defer / seer.short_fraction: with "first_finisher", how far (a share of the rollout's
        request count, in pops) a request of a known short group is moved back, and the first
        finisher's length (a share of max_tokens) under which a group counts as short.
    seer.quantile: with "posterior", requests are ranked by this quantile of their remaining
        length (in (0, 1); higher hedges more against long outliers).
    seer.starvation_pops: a request waiting through more than this many pops is served next
        (-1 = auto, 0 = off).
    """
    return ml_collections.ConfigDict(
        {"seer": {"estimator": "hedged", "quantile": 0.995, "starvation_pops": -1,
                  "defer": 0.375, "short_fraction": 0.1875}})


def make_policy(name: str) -> Policy:
    """A fresh production policy object by name; ConfigError for an unknown name."""
    return CATALOG.make(name)


__all__ = [
    "CATALOG",
    "POLICIES",
    "GroupRoundRobinPolicy",
    "GroupState",
    "Hindsight",
    "Policy",
    "PolicyCatalog",
    "RequestFCFSPolicy",
    "RequestState",
    "SeerPolicy",
    "default_policy_options",
    "make_policy",
]
