"""Kernels for the paged engine's hot path: ragged paged attention and KV writes, over per-head
K/V and over multi-head latent attention's latent cache (`mla*`) (TPU Pallas, GPU Pallas/Triton,
jnp reference). Draft-tree acceptance is plain XLA and lives with sampling
(`seer_jax.model.sampling_acceptance`)."""

from seer_jax.pallas.attention import ragged_paged_attention
from seer_jax.pallas.attention_ref import ragged_paged_attention_reference
from seer_jax.pallas.kv_write import write_kv, write_kv_reference
from seer_jax.pallas.mla import ragged_paged_mla_attention
from seer_jax.pallas.mla_write import write_latent

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "ragged_paged_mla_attention",
    "write_kv",
    "write_kv_reference",
    "write_latent",
]
