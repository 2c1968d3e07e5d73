"""`make demo`: a grouped rollout of real SmolLM2 tokens on 2 emulated accelerator slices.

Each engine step runs on this CPU, but the time it stands for is an H100 roofline of the served
model (`time_model="roofline"`), and each slice gets a KV budget that holds only part of the
rollout at once: the regime of a real RL rollout (KV-bound slices, a long tail of long
responses), where divided rollout and context-aware scheduling matter. On the CPU's own step
times the premise does not hold (a step costs about the same whatever it holds).
"""

from seer_jax.rollout.config import default_config


def get_config():
    c = default_config()
    c.model = "smollm2"
    c.prompts = "structured"  # output length differs strongly by prompt: a long tail
    c.num_prompts = 8
    c.group_size = 4
    c.max_tokens = 128
    c.num_instances = 2
    c.tp = 1
    c.controller.chunk_size = 32
    c.time_model = "roofline"
    c.accelerator = "h100"
    c.engine.kv_memory_gib = 0.1
    c.engine.max_num_seqs = 8
    c.policies = "seer,group_round_robin"
    return c
