"""The real model: SmolLM2-135M-Instruct from its GGUF vs transformers loading the same file."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from seer_jax.model import load
    from seer_jax.model.hub import fetch_smollm2

    path = fetch_smollm2()
    cfg, params, tok = load(str(path))
    return path, cfg, params, tok


def test_config_from_gguf(smollm2):
    _, cfg, _, tok = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    assert tok.eos_id == 2


def test_logits_match_transformers_gguf(smollm2):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from seer_jax.model.generate import full_forward

    path, cfg, params, tok = smollm2
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    ref.eval()
    prompts = ["The quick brown fox", "def fibonacci(n):\n    return",
               tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])]
    for text in prompts:
        ids = tok.encode(text)
        ours = np.asarray(full_forward(params, cfg, np.array([ids])))[0]
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(ours, theirs, atol=1e-3, rtol=0)


def test_greedy_chat_answer_paris():
    out = subprocess.run(
        [sys.executable, "-m", "seer_jax.cli", "generate", "--model", "smollm2", "--chat",
         "--prompt", "What is the capital of France?", "--max-tokens", "24", "--json"],
        capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert "Paris" in result["text"]
    assert result["finish_reason"] == "eos" and result["token_ids"][-1] == 2
    assert len(result["logprobs"]) == len(result["token_ids"])
    assert all(lp <= 0 for lp in result["logprobs"])


def assert_greedy_equal_or_tie(params, cfg, prompt, ours, ref):
    """Token for token means: identical, or the first divergence sits where the reference's top-1/top-2
    log-prob margin is below 1e-4."""
    from seer_jax.model.generate import full_forward

    if ours == ref:
        return
    j = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
    logits = np.asarray(full_forward(params, cfg, np.array([prompt + ref[:j + 1]])))[0, len(prompt) + j - 1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] < 1e-4, f"diverged at {j} with margin {top2[1] - top2[0]}"


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.exhaustive), 2])
def test_engine_greedy_equals_reference_generator(smollm2, tp):
    import jax

    from seer_jax.engine.engine import Engine, EngineConfig
    from seer_jax.model.generate import generate
    from seer_jax.model.sharding import make_mesh
    from seer_jax.rollout.core.types import SamplingParams

    _, cfg, params, tok = smollm2
    texts = ["What is the capital of France?", "List three colors.", "Count from one to five.",
             "Write a haiku about the sea."]
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
    ref = generate(params, cfg, prompts, 24)
    mesh = make_mesh(jax.devices()[:tp]) if tp > 1 else None
    eng = Engine(cfg, params, EngineConfig(kv_memory_gib=0.25, max_num_batched_tokens=32,
                                           max_prefill_seqs=2), mesh=mesh)
    out, step, pending = {}, 0, list(enumerate(prompts))
    while pending or eng.has_unfinished():  # requests arrive at different steps; chunked prefill
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            eng.add_request(str(i), p, 24, SamplingParams(temperature=0.0))
        for r in eng.step():
            out[int(r.request_id)] = r
        step += 1
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in eng.step_stats)
    for i, r in enumerate(ref):
        assert_greedy_equal_or_tie(params, cfg, prompts[i], out[i].token_ids, r.token_ids)
        if out[i].token_ids == r.token_ids:
            np.testing.assert_allclose(out[i].logprobs, r.logprobs, atol=1e-4)
