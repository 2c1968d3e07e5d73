"""Rollout benchmark, `structured` mix: output length differs strongly by prompt (long tail)."""

from seer_jax.rollout.config import bench_config


def get_config():
    c = bench_config("structured")
    # chunks of max_tokens / 8, the paper's ratio (8K chunks of 64K-token rollouts)
    c.controller.chunk_size = 64
    # emulated accelerators: each step timed by an H100 roofline of the served model, with a KV
    # budget small enough that slices are KV-bound, as at scale
    c.time_model = "roofline"
    c.engine.kv_memory_gib = 0.5
    return c
