"""Partial rollout on Ray actors: a rollout that returns once one group is complete carries the
others into the next call on the same actors; every request finishes exactly once with the
uninterrupted run's greedy tokens, continuing from its KV in the object-store pool while the
weights stay, and by re-prefill after a weight sync."""

from __future__ import annotations

import pytest

from seer_jax.rollout.backends.ray_cluster import RayBackendConfig
from seer_jax.rollout.core.run import rollout
from tests.rollout.carry_check import CONFIG, GREEDY, MAX, G, check_kv_reuse, reference, two_calls
from tests.rollout.tiny_rollout import CFG, ENGINE, PARAMS

# a cluster and engine actors, on the worker that holds the cluster
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


@pytest.fixture(scope="module")
def actors(ray_cluster):
    from seer_jax.rollout.backends.ray_group import make_ray_instances

    group = make_ray_instances(CFG, PARAMS, num_instances=2, tp=1, engine_config=ENGINE,
                               backend=RayBackendConfig(step_timeout_s=120.0))
    yield group
    group.shutdown()


@pytest.mark.parametrize("synced", [False, True])
def test_carried_requests_finish_once_with_greedy_tokens_on_ray(actors, synced):
    actors.reset()  # fresh engines and pool

    def call(groups, carry, target, version):
        return rollout(groups, group_size=G, max_tokens=MAX, instances=actors.instances,
                       sampling=GREEDY, policy="seer", pool=actors.pool, config=CONFIG,
                       clock="concurrent", carry=carry, target_groups=target,
                       weight_version=version)

    def sync():  # the same weights as a new version: the carried KV is stale
        actors.update_params(PARAMS)

    first, second, carried = two_calls(call, reference(), sync if synced else None)
    check_kv_reuse(second, carried, synced)
    assert first.report.lost_instances == [] and second.report.lost_instances == []
