"""Kimi-K2-shaped rollout iteration (Seer paper): 800 prompts x G=8, max 98,304 tokens,
256 H800 GPUs, one instance per GPU (data-parallel attention, routed experts sharded over all
256 GPUs: expert_parallel=256).

Step costs come from Kimi-K2's real shapes (`seer_jax.costs`, model "kimi-k2": 61 layers, MLA
with a 512 + 64-wide latent cache per token-layer, 384 routed experts top-8 plus one shared):
each step reads the shared weights and the distinct local experts that the EP group's tokens hit.
`benchmarks/paper_setting.py` runs it against the veRL-style baseline beside the paper's numbers.
"""

from seer_jax.sim.config import default_config, preset_workload_fields


def get_config():
    c = default_config()
    c.policies = "seer,group_round_robin,request_fcfs,oracle_lfs"
    c.name = "kimi-k2"
    c.workload.update(preset_workload_fields("kimi-k2"))
    c.cluster.num_instances = 256
    c.cluster.model = "kimi-k2"
    c.cluster.accelerator = "h800"
    c.cluster.chips_per_instance = 1
    c.cluster.expert_parallel = 256
    c.cluster.memory_utilization = 0.9
    c.cluster.token_unit = 16  # 100K-token responses: count in units of 16 tokens (~1% fidelity)
    c.controller.chunk_size = 8192
    c.sweep.num_prompts = 160
    return c
