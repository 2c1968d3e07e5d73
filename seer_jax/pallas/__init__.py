"""Kernels for the paged engine's hot path: ragged paged attention and KV writes (TPU Pallas, GPU
Pallas/Triton, jnp reference), and draft-tree acceptance (XLA)."""

from seer_jax.pallas.acceptance import (
    AcceptResult,
    accept_draft_tree,
    sampling_log_probs,
    verify_tree_parents,
)
from seer_jax.pallas.attention import ragged_paged_attention
from seer_jax.pallas.attention_ref import ragged_paged_attention_reference
from seer_jax.pallas.kv_write import write_kv, write_kv_reference

__all__ = [
    "AcceptResult",
    "accept_draft_tree",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "sampling_log_probs",
    "verify_tree_parents",
    "write_kv",
    "write_kv_reference",
]
