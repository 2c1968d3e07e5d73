"""TPU v6e-32 (Trillium, 32 chips of 32 GB): Llama-3-8B-Instruct (bf16) as 8 instances x tp4.

32 query / 8 KV heads split 4 ways; per device ~3.7 GiB of weights + 20 GiB of KV, of 29.8 GiB.
"""

from seer_jax.integrations.deploy_config import default_config


def get_config():
    c = default_config()
    c.name = "tpu_v6e32_llama3_8b"
    c.platform = "tpu"
    c.model.update(dict(
        name="/models/Meta-Llama-3-8B-Instruct",
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=8192, dtype="bfloat16"))
    c.mesh.update(dict(num_instances=8, tp=4, devices=32, hbm_gib_per_device=29.8, chip="v6e"))
    c.engine.update(dict(page_size=64, num_pages=0, kv_memory_gib=80.0, max_num_seqs=128,
                         max_num_batched_tokens=4096, max_prefill_seqs=8, max_model_len=8192))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=7168, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=500, batch_size=64, learning_rate=1e-6, beta=0.0))
    return c
