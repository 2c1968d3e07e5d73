"""`group_round_robin`: the veRL baseline.

Whole groups are pinned to instances in turn (group i -> i-th live instance modulo their number),
requests are not chunked (one chunk of the whole original max_tokens) and everything is submitted
at once: each instance's own continuous-batching scheduler admits what fits, overcommits KV as
sequences grow and preempts. The controller does the pinning (`divided = False`); this class only
keeps the buffer first-come-first-served (it matters only after an instance is lost).
"""

from __future__ import annotations

from seer_jax.rollout.core.policies.request_fcfs import RequestFCFSPolicy


class GroupRoundRobinPolicy(RequestFCFSPolicy):
    name = "group_round_robin"
    divided = False
    kv_admission = False
