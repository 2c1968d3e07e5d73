"""Moonlight-shaped rollout iteration (Seer paper's workload): 400 prompts x G=8, max 65,536
tokens, 32 instances of 8 x H800 (Moonlight-16B-A3B, MLA latent KV replicated on the 8 TP ranks).
The paper ran Moonlight on 32 GPUs; this preset's larger cluster is the one the results in
docs/results.md use, and `benchmarks/paper_setting.py` runs the published 32 (4 instances).
Step costs come from Moonlight's real shapes (`seer_jax.costs`, model "moonlight-16b-a3b": MLA
with a 512 + 64-wide latent cache, 64 routed experts top-6 plus 2 shared, the first layer dense).

    seer-jax simulate --config configs/sim/moonlight.py [--ablation] [--plots DIR] [--json PATH]
"""

from seer_jax.sim.config import default_config, preset_workload_fields


def get_config():
    c = default_config()
    c.policies = "seer,group_round_robin,request_fcfs,oracle_lfs"
    c.name = "moonlight"
    c.workload.update(preset_workload_fields("moonlight"))
    c.cluster.num_instances = 32
    c.cluster.model = "moonlight-16b-a3b"
    c.cluster.accelerator = "h800"
    c.cluster.chips_per_instance = 8
    c.cluster.kv_replicas = 8
    # Colocated RL: the KV cache gets a small share of HBM (training state stays resident);
    # 0.13 leaves ~230K tokens of replicated MLA KV per instance, so the veRL-style baseline
    # overcommits and preempts thousands of times, as in the paper.
    c.cluster.memory_utilization = 0.13
    c.controller.chunk_size = 8192
    c.sweep.num_prompts = 160
    return c
