"""Rollout benchmark, `natural` mix: math word problems and reasoning questions."""

from seer_jax.rollout.api import bench_config


def get_config():
    return bench_config("natural")
