"""Partial rollout across RL iterations in the simulator: the real controller's carry-over
(`seer_jax.rollout.core.carry`) against waiting for every group, on a workload drawn afresh
each iteration.

Each iteration is one training step that hands B = `groups_per_iteration` complete groups to
the trainer; the weights change between iterations (version + 1), so carried requests re-prefill
their context under the new weights (their old KV is dropped). Without carry-over an iteration
starts B new groups (a fresh draw of the configured workload) and waits for all of them. With
carry-over (over-provisioned, as APRIL does) it runs ceil(B x `oversubscription`) groups: the
carried ones plus enough new ones, returns once B of them are complete and carries the rest. Reported: generated tokens per second over all iterations, groups handed
to the trainer per second, and how many of the returned tokens are off-policy (generated under
older weights) and how old they are.
"""

from __future__ import annotations

import dataclasses
import math
import time

import ml_collections
import numpy as np

from seer_jax.rollout.core.policies import CATALOG, Hindsight, PolicyCatalog
from seer_jax.rollout.core.policies.base import options_for
from seer_jax.sim.config import build_workload
from seer_jax.sim.simulator import PROMPT_TOKEN_ID, controller_config, sim_instances


@dataclasses.dataclass
class IterationsRun:
    carry_over: bool
    iterations: list[dict]  # per iteration: time, tokens generated, groups returned, versions
    wall_s: float

    def summary(self, skip: int = 0) -> dict:
        """Totals over the iterations after the first `skip` (the carry pool's warm-up)."""
        its = self.iterations[skip:]
        t = sum(i["makespan_s"] for i in its)
        gen = sum(i["generated_tokens"] for i in its)
        ret_tokens = sum(i["returned_tokens"] for i in its)
        off = sum(i["off_policy_tokens"] for i in its)
        age = sum(i["mean_age_of_off_policy_tokens"] * i["off_policy_tokens"] for i in its)
        return {
            "carry_over": self.carry_over, "iterations": len(its), "time_s": t,
            "generated_tokens": gen, "tokens_per_s": gen / t if t else 0.0,
            "groups_returned": sum(i["groups_returned"] for i in its),
            "groups_per_s": sum(i["groups_returned"] for i in its) / t if t else 0.0,
            "returned_tokens": ret_tokens,
            "off_policy_share": off / ret_tokens if ret_tokens else 0.0,
            "mean_age_of_off_policy_tokens": age / off if off else 0.0,
            "max_age": max((i["max_age"] for i in its), default=0),
            "carried_groups_at_end": self.iterations[-1]["carried_groups"],
            "reprefill_tokens": sum(i["reprefill_tokens"] for i in its),
        }


def simulate_iterations(cfg: ml_collections.ConfigDict, policy: str, *, iterations: int,
                        groups_per_iteration: int, carry_over: bool, seed: int = 0,
                        oversubscription: float = 1.25,
                        catalog: PolicyCatalog = CATALOG) -> IterationsRun:
    """Run `iterations` training steps' rollouts on `cfg`'s cluster (see the module docstring).
    Iteration i draws its groups with workload seed `seed * 1000 + i` (the same draws with and
    without carry-over). Lengths and tokens are in real tokens (cluster.token_unit applied)."""
    from seer_jax.rollout.backends.kv_pool import HostKVPool
    from seer_jax.rollout.core.carry import CarryOver, combined_groups, version_stats
    from seer_jax.rollout.core.controller import Controller
    from seer_jax.rollout.core.driver import EmulatedClusterDriver

    q = int(cfg.cluster.token_unit)
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    launch = math.ceil(groups_per_iteration * oversubscription) if carry_over else groups_per_iteration
    lengths: dict[str, int] = {}  # request id -> output length in simulated tokens
    prompt_len: dict[str, int] = {}  # group id -> prompt length in simulated tokens
    carry = CarryOver()
    rows = []
    t0 = time.perf_counter()
    for it in range(iterations):
        cfg.workload.trace_num_groups = max(1, launch - len(carry))
        work = build_workload(cfg, seed=seed * 1000 + it)
        group_size = int(np.bincount(work.group_index)[0])
        ids = carry.new_group_ids(work.num_groups)
        for g, idx in enumerate(work.groups()):
            prompt_len[ids[g]] = max(1, round(int(work.prompt_len[idx[0]]) / q))
            for j, i in enumerate(idx):
                lengths[f"{ids[g]}/{j}"] = -(-int(work.output_len[i]) // q)
        pool = HostKVPool()  # fresh instances and pool: the weights changed
        instances = sim_instances(cfg, lengths, pool, int(cfg.cluster.num_instances), False,
                                  group_size)
        pol = catalog.make(policy, Hindsight(true_lengths=lengths))
        max_tokens = -(-int(work.max_tokens) // q)
        prompts, gids = combined_groups(carry, [(PROMPT_TOKEN_ID,) * prompt_len[i] for i in ids],
                                        ids)
        ctl = Controller(prompts, group_size=group_size, max_tokens=max_tokens,
                         instances=instances, policy=pol, config=controller_config(cfg), pool=pool,
                         group_ids=gids, policy_options=options_for(pol, cfg.policy.to_dict()),
                         target_groups=groups_per_iteration if carry_over else None,
                         weight_version=it)
        carry.restore_into(ctl, it, pool)
        driver = EmulatedClusterDriver(ctl)
        driver.run()
        results = ctl.results()
        carry.collect(ctl, it)
        vs = version_stats(results, it)
        rows.append({
            "iteration": it, "new_groups": work.num_groups, "makespan_s": driver.end_time,
            "generated_tokens": ctl.output_tokens * q,
            "groups_returned": len({r.group_id for r in results}),
            "returned_tokens": vs["tokens"] * q, "off_policy_tokens": vs["off_policy_tokens"] * q,
            "mean_age_of_off_policy_tokens": vs["mean_age_of_off_policy_tokens"],
            "max_age": vs["max_age"], "carried_groups": len(carry),
            "carried_unfinished_requests": carry.unfinished_requests,
            "reprefill_tokens": ctl.stats.reprefill_tokens * q,
        })
    return IterationsRun(carry_over, rows, time.perf_counter() - t0)
