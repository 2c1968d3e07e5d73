"""One synchronous rollout end to end: a controller, the driver of a clock world, the report."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from seer_jax.errors import ConfigError
from seer_jax.rollout.core.concurrent_driver import ConcurrentDriver
from seer_jax.rollout.core.controller import (
    Controller,
    ControllerConfig,
    ProgressFn,
    ResponseResult,
)
from seer_jax.rollout.core.driver import make_driver
from seer_jax.rollout.core.instance import Instance, KVPool
from seer_jax.rollout.core.policies import Policy
from seer_jax.rollout.core.report import RolloutReport, build_report
from seer_jax.rollout.core.types import SamplingParams


@dataclasses.dataclass
class RolloutOutput:
    results: list[ResponseResult]
    report: RolloutReport


def rollout(
    groups: Sequence[Sequence[int]],
    *,
    group_size: int,
    max_tokens: int,
    instances: Sequence[Instance],
    sampling: SamplingParams | None = None,
    policy: str | Policy = "seer",
    config: ControllerConfig | Mapping[str, Any] | None = None,
    pool: KVPool | None = None,
    clock: str = "emulated",
    wall_clock: Callable[[], float] | None = None,
    group_ids: Sequence[str] | None = None,
    progress: ProgressFn | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    policy_options: Mapping[str, Any] | None = None,
    fault: Any = None,
    replacer: Any = None,
) -> RolloutOutput:
    """Run one synchronous rollout: every group's prompt sampled `group_size` times.

    groups: prompt token ids, one sequence per group. instances: `Instance`s with ids 0..N-1
    (they must share `pool` for KV moves between chunks). policy: a name in `POLICIES` or a
    built `Policy`; policy_options: its own options (e.g. seer's estimator and quantile).
    clock: "emulated" (`EmulatedClusterDriver`, per-instance virtual clocks) or "wall"
    (`WallClockDriver`, `wall_clock` defaults to time.perf_counter) or "concurrent"
    (`ConcurrentDriver`: every instance steps at once; `fault`: a `FaultPlan` to inject;
    `replacer`: starts an instance for each lost one, e.g. the `RayInstanceGroup`).
    Returns every response (group order, then sample order) and the rollout report.
    """
    ctl = Controller(
        groups,
        group_size=group_size,
        max_tokens=max_tokens,
        instances=instances,
        sampling=sampling,
        policy=policy,
        config=config,
        pool=pool,
        group_ids=group_ids,
        progress=progress,
        policy_options=policy_options,
    )
    if clock == "concurrent":
        driver = ConcurrentDriver(ctl, wall_clock, fault, replacer)
    elif fault is not None:
        raise ConfigError(f"clock={clock!r} with fault injection is invalid; allowed: 'concurrent'")
    elif replacer is not None:
        raise ConfigError(f"clock={clock!r} with replacement of lost instances is invalid; "
                          "allowed: 'concurrent'")
    else:
        driver = make_driver(clock, ctl, wall_clock=wall_clock)
    driver.run()
    results = ctl.results(detokenize)
    report = build_report(results, ctl, driver, pool=pool)
    return RolloutOutput(results=results, report=report)
