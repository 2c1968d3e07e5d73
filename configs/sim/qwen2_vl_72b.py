"""Qwen2-VL-72B-shaped rollout iteration (Seer paper): 600 prompts x G=16, max 40,960 tokens,
32 instances of 8 x H800 (dense 72B, GQA KV sharded over TP=8)."""

from seer_jax.sim.config import default_config, preset_workload_fields


def get_config():
    c = default_config()
    c.policies = "seer,group_round_robin,request_fcfs,oracle_lfs"
    c.name = "qwen2-vl-72b"
    c.workload.update(preset_workload_fields("qwen2-vl-72b"))
    c.cluster.num_instances = 32
    c.cluster.model = "qwen2-vl-72b"
    c.cluster.accelerator = "h800"
    c.cluster.chips_per_instance = 8
    c.cluster.memory_utilization = 0.5
    c.controller.chunk_size = 8192
    c.sweep.num_prompts = 160
    return c
