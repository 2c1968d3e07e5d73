"""A small, fast preset for tests and quick looks: 32 prompts x G=8, max 4,096 tokens,
4 instances of one H100 running Llama-3-8B."""

from seer_jax.sim.config import default_config


def get_config():
    c = default_config()
    c.policies = "seer,group_round_robin,request_fcfs,oracle_lfs"
    c.name = "small"
    c.workload.num_prompts = 32
    c.workload.group_size = 8
    c.workload.max_tokens = 4096
    c.workload.min_tokens = 8
    c.workload.prompt_len = 256
    c.cluster.num_instances = 4
    c.cluster.model = "llama-3-8b"
    c.cluster.accelerator = "h100"
    c.cluster.chips_per_instance = 1
    c.cluster.memory_utilization = 0.3
    c.controller.chunk_size = 1024
    c.controller.balance_threshold = 8
    c.sweep.iccs = [0.0, 0.5, 0.9]
    c.sweep.sigmas = [0.6, 1.2]
    return c
