"""Rollout benchmark, `structured` mix: output length differs strongly by prompt (long tail)."""

from seer_jax.rollout.api import default_config


def get_config():
    c = default_config()
    c.prompts = "structured"
    c.num_prompts = 32
    c.group_size = 8
    c.max_tokens = 512
    c.temperature = 1.0
    c.num_instances = 4
    c.tp = 1
    c.chunk_size = 128
    c.compare = "group_round_robin,request_fcfs,seer,oracle_lfs"
    c.engine.max_num_seqs = 64
    c.engine.kv_memory_gib = 1.0
    return c
