"""A real reasoning-model length trace at the Moonlight cluster shape: DeepSeek-R1-Distill-
Qwen-1.5B on AIME (benchmarks/data/r1_aime_lengths.jsonl: 372 problems x 8 samples, capped at
16,000 tokens, length ICC 0.62) resampled to 400 groups (the workload seed picks the draw),
on 32 instances of 8 x H800 as in configs/sim/moonlight.py. max_tokens is the trace's own
(16,000); chunks are max_tokens / 8 as in the Moonlight preset (65,536 / 8).

    seer-jax simulate --config configs/sim/r1_aime.py [--config.seed=1] [--ablation]
"""

import pathlib

from seer_jax.sim.config import default_config

TRACE = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/data/r1_aime_lengths.jsonl"
TRACE_MAX_TOKENS = 16000  # the trace's cap (its "max_tokens" field)


def get_config():
    c = default_config()
    c.name = "r1_aime"
    c.workload.trace_path = str(TRACE)
    c.workload.trace_num_groups = 400
    c.cluster.num_instances = 32
    c.cluster.model = "moonlight-16b-a3b"
    c.cluster.accelerator = "h800"
    c.cluster.chips_per_instance = 8
    c.cluster.kv_replicas = 8
    c.cluster.memory_utilization = 0.13  # as configs/sim/moonlight.py (colocated RL)
    c.controller.chunk_size = TRACE_MAX_TOKENS // 8
    c.policies = "seer,group_round_robin,request_fcfs,oracle_lfs"
    return c
