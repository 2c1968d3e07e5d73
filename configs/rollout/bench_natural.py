"""Rollout benchmark, `natural` mix: math word problems and reasoning questions."""

from seer_jax.rollout.config import bench_config


def get_config():
    c = bench_config("natural")
    # emulated accelerators: each step timed by an H100 roofline of the served model
    c.time_model = "roofline"
    return c
