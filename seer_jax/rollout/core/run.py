"""One synchronous rollout end to end: a controller, the driver of a clock world, the report."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from seer_jax.errors import ConfigError, InputError
from seer_jax.rollout.core.carry import CarryOver, combined_groups
from seer_jax.rollout.core.concurrent_driver import ConcurrentDriver
from seer_jax.rollout.core.controller import Controller
from seer_jax.rollout.core.driver import make_driver
from seer_jax.rollout.core.journal import RequestRecord
from seer_jax.rollout.core.report import RolloutReport, build_report
from seer_jax.rollout.core.results import ResponseResult

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RolloutOutput:
    results: list[ResponseResult]
    report: RolloutReport


def rollout(
    groups: Sequence[Sequence[int]],
    *,
    clock: str = "emulated",
    wall_clock: Callable[[], float] | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    fault: Any = None,
    replacer: Any = None,
    restore: Sequence[RequestRecord] = (),
    carry: CarryOver | None = None,
    configured_instances: int | None = None,
    **controller_args: Any,
) -> RolloutOutput:
    """Run one synchronous rollout: every group's prompt sampled `group_size` times.

    groups: prompt token ids, one sequence per group. controller_args: the `Controller`'s
    keyword arguments: group_size, max_tokens, instances (`Instance`s with ids 0..N-1; they must
    share `pool` for KV moves between chunks), sampling, policy (a name in `POLICIES` or a
    built `Policy`), config, pool, group_ids, progress, policy_options (the policy's own
    options, e.g. seer's estimator and quantile), journal (records every chunk end and finished
    response as it happens, a `JournalWriter`), target_groups, weight_version (the version of
    the weights the instances serve, recorded with every token: `ResponseResult.weight_versions`).
    clock: "emulated" (`EmulatedClusterDriver`, per-instance virtual clocks) or "wall"
    (`WallClockDriver`, `wall_clock` defaults to time.perf_counter) or "concurrent"
    (`ConcurrentDriver`: every instance steps at once; `fault`: a `FaultPlan` to inject;
    `replacer`: starts an instance for each lost one, e.g. the `RayInstanceGroup`).
    restore: what a resumed journal holds (finished responses are returned as recorded,
    unfinished requests continue after their tokens by re-prefill).
    carry: partial rollout across calls (`seer_jax.rollout.core.carry`): the groups an earlier
    call left unfinished run too, and the call returns once `target_groups` groups (default:
    all) are complete, carrying the rest to the next call.
    configured_instances: how many instances the deployment has when all are live; with fewer
    `instances` the report and the log say so.
    Returns every response (group order, then sample order) and the rollout report.
    """
    target_groups = controller_args.get("target_groups")
    if carry is not None:
        group_size = controller_args.get("group_size")
        sizes = sorted({len(g.records) for g in carry.groups} - {group_size})
        if sizes:
            raise InputError(f"group_size={group_size} but the carried groups have {sizes} "
                             "samples; a carry-over call keeps the group size of the calls before")
        groups, controller_args["group_ids"] = combined_groups(
            carry, groups, controller_args.get("group_ids"))
    elif target_groups is not None:
        raise ConfigError(f"target_groups={target_groups!r} without carry is invalid: the "
                          "unfinished groups would be lost; pass carry=CarryOver()")
    ctl = Controller(groups, **controller_args)
    instances, pool, weight_version = ctl.instances, ctl.pool, ctl.weight_version
    for rec in restore:
        ctl.restore(rec)
    if carry is not None:
        carry.restore_into(ctl, weight_version, pool)
    if clock == "concurrent":
        driver = ConcurrentDriver(ctl, wall_clock, fault, replacer)
    elif fault is not None:
        raise ConfigError(f"clock={clock!r} with fault injection is invalid; allowed: 'concurrent'")
    elif replacer is not None:
        raise ConfigError(f"clock={clock!r} with replacement of lost instances is invalid; "
                          "allowed: 'concurrent'")
    else:
        driver = make_driver(clock, ctl, wall_clock=wall_clock)
    fewer = configured_instances is not None and len(instances) < configured_instances
    if fewer:
        log.warning("the rollout starts on %d of %d configured instances", len(instances),
                    configured_instances)
    driver.run()
    results = ctl.results(detokenize)
    if carry is not None:
        carry.collect(ctl, weight_version)
    report = build_report(results, ctl, driver, pool=pool)
    if fewer:
        report.configured_instances = configured_instances
    return RolloutOutput(results=results, report=report)
