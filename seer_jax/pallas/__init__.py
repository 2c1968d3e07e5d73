"""Kernels for the paged engine's hot path: ragged paged attention and KV writes (TPU Pallas, GPU
Pallas/Triton, jnp reference). Draft-tree acceptance is plain XLA and lives with sampling
(`seer_jax.model.sampling_acceptance`)."""

from seer_jax.pallas.attention import ragged_paged_attention
from seer_jax.pallas.attention_ref import ragged_paged_attention_reference
from seer_jax.pallas.kv_write import write_kv, write_kv_reference

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "write_kv",
    "write_kv_reference",
]
