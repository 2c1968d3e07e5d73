"""Four 8xH100 hosts: Llama-3.1-405B-Instruct (bf16) as 2 instances x tp16, each slice spanning
two hosts.

405B parameters in bf16 (~756 GiB) do not fit one 8x80 GB host, so a slice is 16 GPUs on two
hosts: one Ray actor per host (8 GPUs each) and the two actors of a slice joined under
jax.distributed, tensor parallelism crossing the hosts' network. 128 query heads and 8 KV heads
split over tp16 (each KV head held by two devices). Per device: ~47 GiB of weights (all
split 16 ways but the norms) + at most the slice's 16 GiB of KV (what validate_config counts, since 8 KV heads
do not split 16 ways), of 74 GiB usable HBM.
"""

from seer_jax.integrations.deploy_config import default_config


def get_config():
    c = default_config()
    c.name = "gpu_4x8xh100_llama31_405b"
    c.platform = "gpu"
    c.model.update(dict(
        name="/models/Llama-3.1-405B-Instruct",  # a local HF directory (safetensors + config.json)
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=16384,
        intermediate_size=53248, num_layers=126, num_heads=128, num_kv_heads=8, head_dim=128,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=131072, dtype="bfloat16"))
    c.mesh.update(dict(num_instances=2, tp=16, devices=32, hbm_gib_per_device=74.0, chip="h100"))
    c.engine.update(dict(page_size=16, num_pages=0, kv_memory_gib=16.0, max_num_seqs=128,
                         max_num_batched_tokens=4096, max_prefill_seqs=8, max_model_len=9216))
    # one Ray actor and one bundle of 8 GPUs per host, each host its own (STRICT_SPREAD); the two
    # hosts of a slice run one engine under jax.distributed
    c.backend.update(dict(kind="ray", resource="GPU", strategy="STRICT_SPREAD", hosts_per_slice=2))
    # grouped speculation: every engine actor drafts from its replica of the draft service
    # (2 shard actors; replicas at most one step stale)
    c.engine.speculation = True
    c.draft_service.update(dict(shards=2, max_stale_steps=1, sync_every_steps=1))
    c.policies = "seer"
    c.controller.chunk_size = 2048
    c.sampling.update(dict(group_size=8, max_tokens=8192, max_prompt_length=1024,
                           temperature=1.0, top_p=1.0, top_k=0))
    c.trainer.update(dict(num_steps=100, batch_size=32, learning_rate=1e-6, beta=0.0))
    return c
