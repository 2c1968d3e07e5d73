"""Public ragged paged MLA attention: one entry point, dispatch to reference / TPU / GPU kernels.

See `mla_ref` for the absorbed form the kernels compute and `mla_layout` for the latent cache.
"""

from __future__ import annotations

import jax
import numpy as np

from seer_jax.errors import InputError
from seer_jax.pallas.checks import check_attention_inputs, resolve_impl
from seer_jax.pallas.mla_ref import mla_attention_reference


def check_mla_inputs(q_latent, q_rope, latent_pages, layer) -> None:
    """Raise InputError unless the queries and the latent cache agree."""
    for name, x in (("q_latent", q_latent), ("q_rope", q_rope)):
        if getattr(x, "ndim", None) != 3:
            raise InputError(f"{name} must be [num_tokens, num_heads, dim], got "
                             f"{getattr(x, 'shape', None)}")
    if q_latent.shape[:2] != q_rope.shape[:2]:
        raise InputError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape} must share "
                         "[num_tokens, num_heads]")
    rank = 3 if layer is None else 4
    if getattr(latent_pages, "ndim", None) != rank:
        want = "[total_pages, page_size, kv_lora_rank + qk_rope_head_dim]"
        if layer is not None:
            want = "[num_layers, " + want[1:] + " (a layer index is given)"
        raise InputError(f"latent_pages must be {want}, got {latent_pages.shape}")
    width = q_latent.shape[2] + q_rope.shape[2]
    if latent_pages.shape[-1] != width:
        raise InputError(f"latent_pages rows hold {latent_pages.shape[-1]} values; q_latent "
                         f"({q_latent.shape[2]}) + q_rope ({q_rope.shape[2]}) = {width}")
    if not (q_latent.dtype == q_rope.dtype == latent_pages.dtype):
        raise InputError(f"dtypes differ: q_latent {q_latent.dtype}, q_rope {q_rope.dtype}, "
                         f"latent_pages {latent_pages.dtype}")


def ragged_paged_mla_attention(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    tree_parents: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
    max_q_len: int | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """Ragged paged MLA (absorbed form) -> [num_tokens, num_heads, kv_lora_rank].

    Args:
      q_latent: [num_tokens, num_heads, kv_lora_rank] no-RoPE queries already multiplied into
        the latent space (by each head's key up-projection).
      q_rope: [num_tokens, num_heads, qk_rope_head_dim] RoPE queries (RoPE applied).
      latent_pages: [total_pages, page_size, kv_lora_rank + qk_rope_head_dim] rows [c_kv, k_rope]
        shared by every head (see `mla_layout`), new tokens already written (`write_latent`); or
        the whole cache [num_layers, ...] with `layer`.
      kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents / tree_mask, layer: as for
        `seer_jax.pallas.ragged_paged_attention` (ragged packed queries, causal offset
        kv_len - q_len, draft trees over each sequence's query tokens).
      sm_scale: the softmax scale (for DeepSeek-V3: (qk_nope + qk_rope head dims) ** -0.5, times
        the YaRN mscale squared); no default, the shapes here do not determine it.
      impl: "auto" (TPU kernel on TPU, GPU kernel on GPU, else reference), "reference", "tpu",
        "gpu". interpret: run the chosen kernel in interpret mode (CPU).
      max_q_len: static bound on any q_len (reference only). block_q, pages_per_block,
        num_kv_splits: kernel tiling (None = defaults).

    Returns the attention output in the latent space; the caller applies each head's value
    up-projection (and the output projection) after.
    """
    if tree_parents is not None and tree_mask is not None:
        raise InputError("pass tree_parents or its alias tree_mask, not both")
    tree_parents = tree_mask if tree_parents is None else tree_parents
    check_mla_inputs(q_latent, q_rope, latent_pages, layer)
    # the ragged-batch checks of the dense API, on a one-KV-head view of the shapes
    num_tokens, num_heads, _ = q_latent.shape
    view_q = jax.ShapeDtypeStruct((num_tokens, num_heads, 1), np.float32)
    view_kv = jax.ShapeDtypeStruct((1, latent_pages.shape[-2], 2, 1), np.float32)
    check_attention_inputs(view_q, view_kv, kv_lens, page_indices, cu_q_lens, num_seqs,
                           tree_parents)
    which = resolve_impl(impl)
    if which == "reference":
        return mla_attention_reference(
            q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, tree_parents=tree_parents, max_q_len=max_q_len, layer=layer)
    if which == "tpu":
        from seer_jax.pallas.mla_tpu import mla_attention_tpu

        return mla_attention_tpu(
            q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, tree_parents=tree_parents, interpret=interpret, block_q=block_q,
            pages_per_block=pages_per_block, layer=layer)
    from seer_jax.pallas.mla_gpu import mla_attention_gpu

    return mla_attention_gpu(
        q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, tree_parents=tree_parents, interpret=interpret, block_q=block_q,
        pages_per_block=pages_per_block, num_kv_splits=num_kv_splits, layer=layer)
