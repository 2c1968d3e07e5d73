"""TPU v5p-64 pod slice: Qwen2.5-7B-Instruct (bf16) as 8 instances x tp4.

v5p-64 counts TensorCores: 32 chips, and JAX sees one device per chip (megacore), so the rollout
mesh has 32 devices. tp4 because Qwen2.5-7B has 28 query heads (tp8 does not divide them) and 4 KV
heads (one per device at tp4). Per device: ~3.6 GiB of weights (the embedding and LM head split over tp too) + 60 GiB of KV,
of 95 GiB HBM.
"""

from seer_jax.integrations.deploy_config import default_config


def get_config():
    c = default_config()
    c.name = "tpu_v5p64_qwen25_7b"
    c.platform = "tpu"
    c.model.update(dict(
        name="/models/Qwen2.5-7B-Instruct",
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=32768, dtype="bfloat16"))
    c.mesh.update(dict(num_instances=8, tp=4, devices=32, hbm_gib_per_device=88.0, chip="v5p"))
    c.engine.update(dict(page_size=64, num_pages=0, kv_memory_gib=240.0, max_num_seqs=256,
                         max_num_batched_tokens=8192, max_prefill_seqs=8, max_model_len=33792))
    # one Ray actor per slice, each slice on its own host (4 chips = one v5p host)
    c.backend.update(dict(kind="ray", resource="TPU", strategy="STRICT_SPREAD"))
    # grouped speculation: every engine actor drafts from its replica of the draft service
    # (2 shard actors; replicas at most one step stale)
    c.engine.speculation = True
    c.draft_service.update(dict(shards=2, max_stale_steps=1, sync_every_steps=1))
    c.policies = "seer"
    c.controller.chunk_size = 8192
    c.sampling.update(dict(group_size=16, max_tokens=32768, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=500, batch_size=128, learning_rate=1e-6, beta=0.0))
    return c
