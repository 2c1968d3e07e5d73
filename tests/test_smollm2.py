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
