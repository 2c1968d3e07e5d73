"""Rollout benchmark, `structured` mix: output length differs strongly by prompt (long tail)."""

from seer_jax.rollout.api import bench_config


def get_config():
    return bench_config("structured")
