"""Synthetic grouped rollouts for drafting tests and benchmarks (until real SmolLM2 rollouts).

A small template/Markov source with the properties that matter for drafting:
- siblings (same prompt) follow a shared per-group plan of phrases, each kept with some
  probability and lightly mutated, so they share long spans but diverge;
- a global phrase bank (boilerplate shared by all groups), Zipf-distributed filler tokens;
- responses sometimes quote the prompt or repeat their own earlier spans (what per-request
  suffix decoding can exploit).

Two mixes: `natural` (loose plans, more filler: chat-like) and `structured` (tight plans, long
phrases: templated/structured outputs).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seer_jax.analysis.drafting_replay import GroupRollout
from seer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SyntheticMix:
    vocab_size: int = 4000
    zipf_a: float = 1.2
    num_global_phrases: int = 200
    phrase_len: tuple[int, int] = (3, 12)
    plan_len: int = 40  # group plan segments
    plan_phrase_len: tuple[int, int] = (4, 24)
    keep_prob: float = 0.6  # a sibling follows the plan segment
    mutate_prob: float = 0.05  # per token inside a kept segment
    global_phrase_prob: float = 0.15
    quote_prompt_prob: float = 0.05
    self_repeat_prob: float = 0.05
    filler_len: tuple[int, int] = (1, 8)
    prompt_len: tuple[int, int] = (20, 120)


MIXES: dict[str, SyntheticMix] = {
    "natural": SyntheticMix(
        keep_prob=0.3, mutate_prob=0.2, global_phrase_prob=0.1, filler_len=(2, 12),
        plan_phrase_len=(3, 12),
    ),
    "structured": SyntheticMix(
        keep_prob=0.7, mutate_prob=0.05, plan_phrase_len=(6, 30), global_phrase_prob=0.1,
        filler_len=(1, 6),
    ),
}


def synthetic_groups(
    num_groups: int = 16,
    group_size: int = 8,
    response_len: int = 256,
    mix: str | SyntheticMix = "natural",
    seed: int = 0,
    length_jitter: float = 0.25,
) -> list[GroupRollout]:
    """`num_groups` groups of `group_size` responses, each about `response_len` tokens
    (± length_jitter, uniformly)."""
    if isinstance(mix, str):
        if mix not in MIXES:
            raise ConfigError(f"unknown synthetic mix {mix!r}; known: {sorted(MIXES)}")
        mix = MIXES[mix]
    rng = np.random.default_rng(seed)
    v = mix.vocab_size

    def zipf_tokens(n: int) -> list[int]:
        return [int(t) % (v - 16) + 16 for t in rng.zipf(mix.zipf_a, size=n)]

    def phrase(lo_hi: tuple[int, int]) -> list[int]:
        return zipf_tokens(int(rng.integers(lo_hi[0], lo_hi[1] + 1)))

    global_phrases = [phrase(mix.phrase_len) for _ in range(mix.num_global_phrases)]
    groups = []
    for g in range(num_groups):
        prompt = zipf_tokens(int(rng.integers(mix.prompt_len[0], mix.prompt_len[1] + 1)))
        plan = [phrase(mix.plan_phrase_len) for _ in range(mix.plan_len)]
        responses = []
        for _ in range(group_size):
            target = max(1, int(response_len * (1 + length_jitter * rng.uniform(-1, 1))))
            out: list[int] = []
            seg = 0
            while len(out) < target:
                u = rng.random()
                if u < mix.quote_prompt_prob and len(prompt) > 4:
                    a = int(rng.integers(0, len(prompt) - 4))
                    out.extend(prompt[a : a + int(rng.integers(4, 16))])
                elif u < mix.quote_prompt_prob + mix.self_repeat_prob and len(out) > 8:
                    a = int(rng.integers(0, len(out) - 4))
                    out.extend(out[a : a + int(rng.integers(4, 16))])
                elif u < mix.quote_prompt_prob + mix.self_repeat_prob + mix.global_phrase_prob:
                    out.extend(global_phrases[int(rng.integers(len(global_phrases)))])
                elif seg < len(plan) and rng.random() < mix.keep_prob:
                    for t in plan[seg]:
                        out.append(zipf_tokens(1)[0] if rng.random() < mix.mutate_prob else t)
                    seg += 1
                else:
                    if seg < len(plan) and rng.random() < 0.5:
                        seg += 1  # skip a plan segment
                    out.extend(phrase(mix.filler_len))
            responses.append(out[:target])
        groups.append(GroupRollout(group_id=f"g{g}", prompt_ids=prompt, responses=responses))
    return groups
