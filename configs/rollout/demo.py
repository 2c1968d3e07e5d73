"""`make demo`: a small grouped rollout of SmolLM2 on 2 emulated instances, seer vs veRL-style."""

from seer_jax.rollout.api import default_config


def get_config():
    c = default_config()
    c.model = "smollm2"
    c.prompts = "structured"
    c.num_prompts = 6
    c.group_size = 4
    c.max_tokens = 96
    c.num_instances = 2
    c.tp = 1
    c.controller.chunk_size = 32
    c.policies = "seer,group_round_robin"
    return c
