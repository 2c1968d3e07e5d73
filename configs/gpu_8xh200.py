"""One 8xH200 host: Qwen2.5-7B-Instruct (bf16) as 4 instances x tp2.

Per device: ~7.1 GiB of weights (embedding and LM head split too) + 80 GiB of KV (engine.kv_memory_gib
is per instance, split over its tp devices), of 131 GiB HBM.
The rest is left to the trainer when it is colocated.
"""

from seer_jax.integrations.deploy_config import default_config


def get_config():
    c = default_config()
    c.name = "gpu_8xh200_qwen25_7b"
    c.platform = "gpu"
    c.model.update(dict(
        name="/models/Qwen2.5-7B-Instruct",  # a local HF directory (safetensors + config.json)
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=32768, dtype="bfloat16"))
    c.mesh.update(dict(num_instances=4, tp=2, devices=8, hbm_gib_per_device=131.0, chip="h200"))
    c.engine.update(dict(page_size=16, num_pages=0, kv_memory_gib=160.0, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_prefill_seqs=8, max_model_len=17408))
    # one Ray actor per tp2 slice, all four on this host
    c.backend.update(dict(kind="ray", resource="GPU", strategy="PACK"))
    # grouped speculation: every engine actor drafts from its replica of the draft service
    # (1 shard actor; replicas at most one step stale)
    c.engine.speculation = True
    c.draft_service.update(dict(shards=1, max_stale_steps=1, sync_every_steps=1))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=16384, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=200, batch_size=64, learning_rate=1e-6, beta=0.0))
    return c
