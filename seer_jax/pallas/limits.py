"""What each kernel can lower for: tile rules, on-chip memory bounds, supported shapes.

One place answers "can impl X serve this shape?", so the kernel wrappers (InputError at trace
time) and the engine (ConfigError when it is built, before the first step) apply the same rules.

TPU (Mosaic): the last two dims of every VMEM block must be multiples of (8, 128) or equal the
array's; bf16 packs two rows per sublane, so q/out row blocks are kept multiples of 16. The
scalar-prefetched operands (page table, lengths, block ranges) live in SMEM, 1 MiB on v4-v6e;
we allow three quarters of it (an assumption not yet checked on a TPU: the rest is left for
Mosaic's own scalars). GPU (Triton): loaded tiles must have power-of-two dims; pointer offsets
switch to 64 bits by themselves for arrays over 4 GiB, so pool size is not bounded here.
"""

from __future__ import annotations

import math

TPU_HEAD_DIMS = (64, 128, 256)
TPU_SMEM_PREFETCH_BYTES = 768 * 1024
TPU_MAX_Q_BLOCK_TOKENS = 32
TPU_KV_BLOCK_TOKENS = 128  # tokens per K/V block the TPU attention kernel streams
TPU_KV_BUFFER_BYTES = 4 * 1024 * 1024  # its double-buffered VMEM K/V scratch, at most
# q blocks of the TPU attention kernel share each K/V fetch among up to this many sub-blocks of
# `tpu_block_q` tokens, while their q, output and softmax state fit TPU_Q_BLOCK_VMEM_BYTES
TPU_MAX_Q_SUB_BLOCKS = 4
TPU_Q_BLOCK_VMEM_BYTES = 8 * 1024 * 1024


def pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def tpu_row_unit(group: int) -> int:
    """Smallest token count whose rows (tokens x group query heads) are a multiple of 16."""
    return 16 // math.gcd(group, 16)


def tpu_block_q(group: int, requested: int | None = None) -> int:
    """Tokens per TPU q block: rows = block_q * group a multiple of 16, about 128 rows, at most
    32 tokens (a decode block visits every sequence it holds, so fewer tokens waste less)."""
    unit = tpu_row_unit(group)
    if requested:
        return -(-int(requested) // unit) * unit
    target = min(TPU_MAX_Q_BLOCK_TOKENS, max(1, 128 // group))
    return max(unit, target // unit * unit)


def tpu_q_sub_blocks(*, num_tokens: int, block_q: int, rows_per_token: int, num_kv_heads: int,
                     head_dim: int, q_bytes: int, requested: int | None = None) -> int:
    """Sub-blocks of `block_q` tokens per TPU attention q block. A q block fetches each K/V
    block of a sequence once for all of its sub-blocks, and a sub-block multiplies only the K/V
    blocks its own rows see: a prefill chunk reads its keys once per q block instead of once per
    `block_q` tokens, while a decode block multiplies no more rows per sequence than one
    sub-block. As many as the tokens fill, at most `TPU_MAX_Q_SUB_BLOCKS`, and no more than the
    VMEM of q and output (double-buffered), f32 accumulator and the lane-padded running max and
    denominator allow."""
    if requested:
        return max(1, int(requested))
    lanes = -(-head_dim // 128) * 128
    per_sub = num_kv_heads * block_q * rows_per_token * (4 * lanes * q_bytes + 4 * lanes
                                                         + 2 * 4 * 128)
    fit = max(1, TPU_Q_BLOCK_VMEM_BYTES // per_sub)
    return max(1, min(TPU_MAX_Q_SUB_BLOCKS, fit, -(-max(num_tokens, 1) // block_q)))


def tpu_pages_per_block(*, num_kv_heads: int, head_dim: int, page_size: int, dtype_bytes: int,
                        pages_per_seq: int, requested: int | None = None) -> int:
    """Pages per TPU K/V block: about `TPU_KV_BLOCK_TOKENS` tokens, fewer when the two VMEM
    buffers of whole pages (every KV head's K and V, rows and lanes padded to the tile) would
    exceed `TPU_KV_BUFFER_BYTES`; never more than a sequence's page table."""
    if requested:
        return max(1, min(int(requested), pages_per_seq))
    rows = -(-2 * num_kv_heads // (8 * max(1, 4 // dtype_bytes))) * 8 * max(1, 4 // dtype_bytes)
    page_bytes = page_size * rows * (-(-head_dim // 128) * 128) * dtype_bytes
    ppb = max(1, TPU_KV_BLOCK_TOKENS // page_size)
    ppb = max(1, min(ppb, TPU_KV_BUFFER_BYTES // (2 * page_bytes)))
    return min(ppb, pages_per_seq)


def tpu_attention_problem(*, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                          dtype_bytes: int, max_seqs: int, pages_per_seq: int,
                          num_tokens: int) -> str | None:
    """Why the TPU attention kernel cannot lower for this shape, or None."""
    if head_dim not in TPU_HEAD_DIMS:
        return f"head_dim={head_dim}; allowed {TPU_HEAD_DIMS}"
    sub = 16 if dtype_bytes == 2 else 8
    if page_size % sub:
        return (f"page_size={page_size} is not a multiple of {sub} (TPU {8 * dtype_bytes}-bit "
                "tile rows; a page is copied into a tiled VMEM buffer)")
    group = num_q_heads // max(num_kv_heads, 1)
    block_q = tpu_block_q(group)
    num_blocks = -(-max(num_tokens, 1) // block_q)
    smem = 4 * (max_seqs * pages_per_seq + 2 * max_seqs + 1 + 2 * num_blocks + 1)
    if smem > TPU_SMEM_PREFETCH_BYTES:
        return (f"page table max_seqs={max_seqs} x pages_per_seq={pages_per_seq} needs {smem} "
                f"bytes of scalar memory (limit {TPU_SMEM_PREFETCH_BYTES}); lower max_num_seqs "
                "or max_model_len, or raise page_size")
    return None


def gpu_attention_problem(*, head_dim: int, page_size: int) -> str | None:
    """Why the GPU (Triton) attention kernel cannot lower for this shape, or None."""
    if head_dim < 16 or head_dim != pow2(head_dim):
        return f"head_dim={head_dim}; the GPU kernel needs a power of two >= 16"
    if page_size != pow2(page_size):
        return f"page_size={page_size}; the GPU kernel needs a power of two"
    return None


def tpu_write_kv_problem(*, head_dim: int, max_tokens: int) -> str | None:
    """Why the TPU KV-write kernel cannot serve this shape, or None."""
    if head_dim % 128 and head_dim not in (64,):
        return f"head_dim={head_dim}; allowed 64 or a multiple of 128"
    if 4 * max_tokens > TPU_SMEM_PREFETCH_BYTES:
        return f"{max_tokens} tokens of slots exceed the scalar memory bound"
    return None


def gpu_write_kv_problem(*, head_dim: int) -> str | None:
    if head_dim != pow2(head_dim):
        return f"head_dim={head_dim}; the GPU KV write needs a power of two"
    return None


def tpu_mla_problem(*, kv_lora_rank: int, rope_dim: int, page_size: int, dtype_bytes: int,
                    max_seqs: int, pages_per_seq: int, num_tokens: int,
                    block_q: int) -> str | None:
    """Why the TPU MLA kernel cannot lower for this shape, or None."""
    if kv_lora_rank % 128:
        return f"kv_lora_rank={kv_lora_rank}; the TPU kernel needs a multiple of 128"
    if rope_dim % 64 and rope_dim % 128:
        return f"qk_rope_head_dim={rope_dim}; the TPU kernel needs 64 or a multiple of 128"
    sub = 16 if dtype_bytes == 2 else 8
    if page_size % sub:
        return (f"page_size={page_size} is not a multiple of {sub} (TPU {8 * dtype_bytes}-bit "
                "tile rows; pages are copied into a tiled VMEM buffer)")
    num_blocks = -(-max(num_tokens, 1) // block_q)
    smem = 4 * (max_seqs * pages_per_seq + 2 * max_seqs + 1 + 2 * num_blocks + 1)
    if smem > TPU_SMEM_PREFETCH_BYTES:
        return (f"page table max_seqs={max_seqs} x pages_per_seq={pages_per_seq} needs {smem} "
                f"bytes of scalar memory (limit {TPU_SMEM_PREFETCH_BYTES})")
    return None


def gpu_mla_problem(*, kv_lora_rank: int, rope_dim: int, page_size: int) -> str | None:
    """Why the GPU MLA kernel cannot lower for this shape, or None."""
    for name, d in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", rope_dim)):
        if d < 16 or d != pow2(d):
            return f"{name}={d}; the GPU kernel needs a power of two >= 16"
    if kv_lora_rank % rope_dim:
        return (f"kv_lora_rank={kv_lora_rank} is not a multiple of qk_rope_head_dim={rope_dim} "
                "(the k_rope lanes are read as one block of the cache row)")
    if page_size != pow2(page_size):
        return f"page_size={page_size}; the GPU kernel needs a power of two"
    return None
