"""Rollout benchmark, `structured` mix: output length differs strongly by prompt (long tail)."""

from seer_jax.rollout.api import bench_config


def get_config():
    c = bench_config("structured")
    # chunks of max_tokens / 8, the paper's ratio (8K chunks of 64K-token rollouts). Measured on
    # the engines: seer 1.44x group_round_robin at 64, 1.38x at 128 (README, issue 6).
    c.controller.chunk_size = 64
    return c
