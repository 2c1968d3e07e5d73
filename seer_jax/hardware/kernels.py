"""Compile the Pallas kernels (KV write; ragged paged attention over decode, mixed and tree
batches) for a target chip, one shard's shapes, with abstract inputs (nothing is allocated).

The kernels are called the way the engine calls them: on the whole [num_layers, pages, page_size,
2 * kv_heads, head_dim] cache (`seer_jax.pallas.kv_layout`) with a traced layer index, its
device layout pinned row-major, the cache donated to the write.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from seer_jax.engine.model_runner import cache_format
from seer_jax.errors import ConfigError
from seer_jax.hardware.targets import devices, get_target
from seer_jax.pallas import ragged_paged_attention, write_kv
from seer_jax.pallas.kv_layout import kv_cache_shape

KERNELS = ("write", "decode", "mixed", "tree")
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel compile: shapes are one shard's (heads per device).

    write: `num_tokens` new tokens; decode: `max_seqs` sequences of one query token; mixed:
    `num_tokens` query tokens over `max_seqs` sequences (prefill chunks next to decodes); tree:
    `max_seqs` draft trees of `tree_size` tokens each."""

    kernel: str
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    num_layers: int = 2
    num_pages: int = 256
    max_seqs: int = 8
    pages_per_seq: int = 16
    num_tokens: int = 64
    tree_size: int = 4

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ConfigError(f"kernel={self.kernel!r}; allowed: {', '.join(KERNELS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; allowed: {', '.join(DTYPES)}")
        if self.q_heads % self.kv_heads:
            raise ConfigError(f"q_heads={self.q_heads} is not a multiple of "
                              f"kv_heads={self.kv_heads}")

    @property
    def label(self) -> str:
        return (f"{self.kernel}-g{self.q_heads // self.kv_heads}-kv{self.kv_heads}"
                f"-d{self.head_dim}-{self.dtype}-s{self.page_size}")


def _abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def lower_kernel(case: KernelCase, target_name: str):
    """The lowered (not yet compiled) kernel call of `case` on one device of the target."""
    target = get_target(target_name)
    dev = devices(target.name, 1)[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    dt = DTYPES[case.dtype]
    impl = target.platform
    fmt = cache_format(sh)
    pool = _abstract(kv_cache_shape(case.num_layers, case.num_pages, case.page_size,
                                    case.kv_heads, case.head_dim), dt, fmt)
    layer = _abstract((), jnp.int32, sh)
    i32 = lambda *shape: _abstract(shape, jnp.int32, sh)
    if case.kernel == "write":
        new = _abstract((case.num_tokens, case.kv_heads, case.head_dim), dt, sh)

        @functools.partial(jax.jit, donate_argnums=0, out_shardings=fmt)
        def write(kv_all, k, v, slots, layer):
            return write_kv(kv_all, k, v, slots, impl=impl, layer=layer)

        return write.lower(pool, new, new, i32(case.num_tokens), layer)
    num_tokens = {"decode": case.max_seqs, "mixed": case.num_tokens,
                  "tree": case.max_seqs * case.tree_size}[case.kernel]
    q = _abstract((num_tokens, case.q_heads, case.head_dim), dt, sh)
    with_tree = case.kernel == "tree"

    @jax.jit
    def attend(q, kv_all, kv_lens, pages, cu, num, layer, parents):
        return ragged_paged_attention(q, kv_all, kv_lens, pages, cu, num, impl=impl,
                                      layer=layer, tree_parents=parents if with_tree else None)

    return attend.lower(q, pool, i32(case.max_seqs),
                        i32(case.max_seqs, case.pages_per_seq), i32(case.max_seqs + 1), i32(),
                        layer, i32(num_tokens))


def compile_kernel(case: KernelCase, target_name: str, matmul_precision: str = "default"):
    """Compile `case` for the target with the target's own compiler (Mosaic for TPU, Triton and
    ptxas for GPU); raises what the compiler raises. Lowered under the process-wide
    `matmul_precision` ("default" is the engine's; the kernels' dots set their own precision, so
    "highest" compiles too)."""
    with jax.default_matmul_precision(matmul_precision):
        return lower_kernel(case, target_name).compile()


def model_case(kernel: str, *, num_heads: int, num_kv_heads: int, head_dim: int, tp: int,
                dtype: str, page_size: int) -> KernelCase:
    """The case of a model served at tensor parallelism `tp` (one shard's heads; fewer KV heads
    than tp are repeated, one per shard, as the engine's cache holds them)."""
    kv = max(1, num_kv_heads // tp)
    return KernelCase(kernel, num_heads // tp, kv, head_dim, dtype, page_size)


MLA_KERNELS = ("mla_write", "mla_decode", "mla_mixed", "mla_tree")


@dataclasses.dataclass(frozen=True)
class MlaCase:
    """One MLA kernel compile at one shard's shapes: `heads` query heads (the model's heads over
    tp); the latent cache [num_layers, pages, page_size, kv_lora_rank + rope_dim] is whole on
    every shard. Batch shapes as in `KernelCase`."""

    kernel: str
    heads: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    page_size: int
    num_layers: int = 2
    num_pages: int = 256
    max_seqs: int = 8
    pages_per_seq: int = 16
    num_tokens: int = 64
    tree_size: int = 4

    def __post_init__(self) -> None:
        if self.kernel not in MLA_KERNELS:
            raise ConfigError(f"kernel={self.kernel!r}; allowed: {', '.join(MLA_KERNELS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; allowed: {', '.join(DTYPES)}")

    @property
    def label(self) -> str:
        batch = (self.num_layers, self.num_pages, self.max_seqs, self.pages_per_seq,
                 self.num_tokens)
        big = "" if batch == (2, 256, 8, 16, 64) else "-L{}-P{}-seqs{}x{}-t{}".format(*batch)
        return (f"{self.kernel}-h{self.heads}-r{self.kv_lora_rank}-rope{self.rope_dim}"
                f"-{self.dtype}-s{self.page_size}{big}")


def lower_mla_kernel(case: MlaCase, target_name: str):
    """The lowered MLA kernel call of `case` on one device of the target (the whole latent
    cache, row-major, a traced layer index; the cache donated to the write)."""
    from jax.experimental.layout import Format
    from jax.experimental.layout import Layout as DeviceLayout

    from seer_jax.pallas.mla import ragged_paged_mla_attention
    from seer_jax.pallas.mla_layout import latent_cache_shape
    from seer_jax.pallas.mla_write import write_latent

    target = get_target(target_name)
    dev = devices(target.name, 1)[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    dt = DTYPES[case.dtype]
    impl = target.platform
    fmt = Format(DeviceLayout(major_to_minor=(0, 1, 2, 3)), sh)
    pool = _abstract(latent_cache_shape(case.num_layers, case.num_pages, case.page_size,
                                        case.kv_lora_rank, case.rope_dim), dt, fmt)
    layer = _abstract((), jnp.int32, sh)
    i32 = lambda *shape: _abstract(shape, jnp.int32, sh)
    if case.kernel == "mla_write":
        @functools.partial(jax.jit, donate_argnums=0, out_shardings=fmt)
        def write(cache, c, r, slots, layer):
            return write_latent(cache, c, r, slots, impl=impl, layer=layer)

        return write.lower(pool, _abstract((case.num_tokens, case.kv_lora_rank), dt, sh),
                           _abstract((case.num_tokens, case.rope_dim), dt, sh),
                           i32(case.num_tokens), layer)
    num_tokens = {"mla_decode": case.max_seqs, "mla_mixed": case.num_tokens,
                  "mla_tree": case.max_seqs * case.tree_size}[case.kernel]
    with_tree = case.kernel == "mla_tree"

    @jax.jit
    def attend(ql, qr, cache, kv_lens, pages, cu, num, layer, parents):
        return ragged_paged_mla_attention(
            ql, qr, cache, kv_lens, pages, cu, num, sm_scale=0.1, impl=impl, layer=layer,
            tree_parents=parents if with_tree else None)

    return attend.lower(_abstract((num_tokens, case.heads, case.kv_lora_rank), dt, sh),
                        _abstract((num_tokens, case.heads, case.rope_dim), dt, sh), pool,
                        i32(case.max_seqs), i32(case.max_seqs, case.pages_per_seq),
                        i32(case.max_seqs + 1), i32(), layer, i32(num_tokens))


def compile_mla_kernel(case: MlaCase, target_name: str):
    """Compile `case` for the target with its own compiler (Mosaic; Triton and ptxas)."""
    return lower_mla_kernel(case, target_name).compile()
