"""Tiny random HF checkpoints written by transformers (an independent reference)."""

from __future__ import annotations

import pathlib

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5)
# mixture-of-experts: 8 experts, top 2
TINY_MOE = dict(TINY, num_experts_per_tok=2, moe_intermediate_size=32)
MOE_KINDS = ("qwen3_moe", "mixtral", "qwen2_moe")
# DeepSeek-V3: multi-head latent attention with a query LoRA, YaRN (past its original context
# from position 32), interleaved RoPE; layer 0 dense, then sigmoid group-limited routing over 8
# experts (2 groups, 1 kept) with a shared expert
TINY_DEEPSEEK_V3 = dict(
    TINY_MOE, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, n_group=2,
    topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rope_interleave=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128})


def make_hf_model(kind: str, out_dir: pathlib.Path, seed: int = 0):
    """Save a tiny random model of `kind` (llama3, qwen2, qwen3, llama_tied, deepseek_v3, or one
    of MOE_KINDS)
    and return the torch model. qwen2_moe has 3 layers, the middle one dense (`mlp_only_layers`)."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "llama3":
        cfg = tf.LlamaConfig(**TINY, rope_theta=50000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY, rope_theta=1e6))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**TINY, head_dim=32, rope_theta=1e6))
    elif kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **TINY_MOE, num_experts=8, norm_topk_prob=True, head_dim=32, rope_theta=1e6))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(
            **{**TINY, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2))
    elif kind == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **{**TINY_MOE, "num_hidden_layers": 3}, num_experts=8, mlp_only_layers=[1],
            shared_expert_intermediate_size=48, rope_theta=1e6))
    elif kind == "deepseek_v2":  # V3's shapes, V2's softmax router (no query LoRA)
        keep = {k: v for k, v in TINY_DEEPSEEK_V3.items()
                if k not in ("n_group", "topk_group", "rope_interleave", "q_lora_rank")}
        model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**keep, q_lora_rank=None,
                                                             topk_method="greedy"))
    elif kind == "deepseek_v3":
        model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**TINY_DEEPSEEK_V3))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them
        for name, p in model.named_parameters():
            if ".gate.weight" in name or "experts" in name or "expert_gate" in name:
                p.normal_(0.0, 0.2 if "gate" in name else 0.05)  # routers and experts inited to 0
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model
