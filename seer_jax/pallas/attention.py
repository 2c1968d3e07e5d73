"""Public ragged paged attention: one entry point, dispatch to reference / TPU / GPU kernels."""

from __future__ import annotations

import jax

from seer_jax.errors import InputError
from seer_jax.pallas.attention_ref import ragged_paged_attention_reference
from seer_jax.pallas.checks import check_attention_inputs, resolve_impl


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    tree_parents: jax.Array | None = None,
    tree_mask: jax.Array | None = None,
    impl: str = "auto",
    interpret: bool = False,
    max_q_len: int | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_kv_splits: int | None = None,
    layer: jax.Array | int | None = None,
    sub_blocks: int | None = None,
) -> jax.Array:
    """Ragged paged attention over a paged KV cache -> [num_tokens, num_q_heads, head_dim].

    Args:
      q: [num_tokens, num_q_heads, head_dim] packed queries of all sequences, in order.
      kv_pages: [total_pages, page_size, 2 * num_kv_heads, head_dim], K and V interleaved per
        KV head (K of head h at 2h, V at 2h + 1; see `seer_jax.pallas.kv_layout`), new tokens
        already written (see `write_kv`).
      kv_lens: [max_seqs] int32, each sequence's length *including* its query tokens.
      page_indices: [max_seqs, pages_per_seq] int32 page table.
      cu_q_lens: [max_seqs + 1] int32 cumulative query lengths (cu_q_lens[0] = 0).
      num_seqs: int32 scalar (may be traced): sequences >= num_seqs are padding and cost nothing
        in the kernels; tokens beyond cu_q_lens[num_seqs] produce zeros.
      sm_scale: softmax scale, default head_dim ** -0.5.
      tree_parents: optional [num_tokens] int32 tree over each sequence's query tokens (parent
        index relative to the sequence's first query token, -1 = the committed context); see
        `seer_jax.pallas.tree`. None = causal chain (decode / prefill). `tree_mask` is an alias.
      impl: "auto" (TPU kernel on TPU, GPU kernel on GPU, else reference), "reference", "tpu",
        "gpu".
      interpret: run the selected kernel in interpret mode (CPU): "tpu" uses the TPU simulator,
        "gpu" the generic Pallas interpreter.
      max_q_len: static upper bound of any sequence's q_len (reference only; speeds it up).
      block_q, pages_per_block, num_kv_splits, sub_blocks: kernel tiling (None = defaults;
        sub_blocks: the TPU kernel's sub-blocks of block_q tokens per q block).
      layer: with it, kv_pages is a whole multi-layer cache
        [num_layers, total_pages, page_size, 2 * num_kv_heads, head_dim] and layer (int or traced
        int32 scalar) picks one; the kernels read that layer's pages in place (no per-layer copy
        of the pool, which slicing `kv_all[layer]` inside a layer scan would cost).

    The query tokens of a sequence are its last q_len positions: token i sits at position
    kv_len - q_len + i and attends causally (or along its tree path) to positions <= its own.
    """
    if tree_parents is not None and tree_mask is not None:
        raise InputError("pass tree_parents or its alias tree_mask, not both")
    tree_parents = tree_mask if tree_parents is None else tree_parents
    kv_view = kv_pages
    if layer is not None:
        if kv_pages.ndim != 5:
            raise InputError("with layer, kv_pages must be [num_layers, total_pages, page_size, "
                             f"2 * num_kv_heads, head_dim], got {kv_pages.shape}")
        kv_view = jax.ShapeDtypeStruct(kv_pages.shape[1:], kv_pages.dtype)
    check_attention_inputs(q, kv_view, kv_lens, page_indices, cu_q_lens, num_seqs, tree_parents)
    which = resolve_impl(impl)
    if which == "reference":
        return ragged_paged_attention_reference(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, tree_parents=tree_parents, max_q_len=max_q_len, layer=layer,
        )
    if which == "tpu":
        from seer_jax.pallas.attention_tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, tree_parents=tree_parents, interpret=interpret,
            block_q=block_q, pages_per_block=pages_per_block, layer=layer,
            sub_blocks=sub_blocks,
        )
    from seer_jax.pallas.attention_gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
        sm_scale=sm_scale, tree_parents=tree_parents, interpret=interpret,
        block_q=block_q, pages_per_block=pages_per_block, num_kv_splits=num_kv_splits,
        layer=layer,
    )
