"""The paged KV cache's layout holds in Mosaic and XLA on TPU, compiled deviceless (libtpu's
whole compiler, so what compiles here compiles on the chip):

- the KV write at page sizes 8..128 (16 and 64 are in test_kernel_compile.py): the per-token
  DMA offset stays off the tiled dimensions, which Mosaic refuses for bf16; the old
  [.., page_size, head_dim] layout's write still fails here, so the check has teeth;
- the whole engine decode step copies or transposes no cache-sized buffer and keeps its
  temporaries well under the cache (the cache's device layout is pinned).

Attention (decode, mixed, tree) at the shipped models' shapes and over the GQA product is in
test_kernel_compile.py. A compiler error fails a test; it never skips one."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seer_jax.hardware.kernels import KernelCase, compile_kernel
from seer_jax.hardware.targets import devices
from tests.hardware.compilers import require_compiler

S = jax.ShapeDtypeStruct
TPUS = ("v5e", "v5p", "v6e")

# (page_size, head_dim, kv_heads) beyond the kernel tests' page sizes 16 and 64, in bf16
WRITE_DEFAULT = [(8, 64, 3), (128, 128, 2)]
WRITE_PRODUCT = [(t, dt, ps, d, hkv) for t, dt, ps, d, hkv in itertools.product(
    TPUS, ("bfloat16", "float32"), (8, 16, 32, 64, 128), (64, 128), (1, 2, 3, 4, 8))]


@pytest.mark.parametrize("page_size,head_dim,kv_heads", WRITE_DEFAULT)
def test_write_kv_compiles_at_other_page_sizes(page_size, head_dim, kv_heads):
    require_compiler("v5e")
    compile_kernel(KernelCase("write", kv_heads, kv_heads, head_dim, "bfloat16", page_size), "v5e")


@pytest.mark.exhaustive
@pytest.mark.parametrize("target,dtype,page_size,head_dim,kv_heads", WRITE_PRODUCT)
def test_write_kv_compiles_over_the_product(target, dtype, page_size, head_dim, kv_heads):
    require_compiler(target)
    compile_kernel(KernelCase("write", kv_heads, kv_heads, head_dim, dtype, page_size), target)


def test_old_page_layout_write_does_not_compile():
    """A per-token DMA at a dynamic page offset into a [.., page_size, head_dim] page (the
    layout this cache replaced) fails in bf16."""
    require_compiler("v5e")
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def kernel(slot_ref, new_hbm, k_in, k_hbm, sem):
        del k_in
        page, off = jax.lax.div(slot_ref[0], 16), jax.lax.rem(slot_ref[0], 16)
        cp = pltpu.make_async_copy(new_hbm.at[0], k_hbm.at[0, :, page, off], sem.at[0])
        cp.start()
        cp.wait()

    def write(k, new, slot):
        return pl.pallas_call(
            kernel, out_shape=S(k.shape, k.dtype), input_output_aliases={2: 0},
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1, grid=(1,),
                in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
                out_specs=pl.BlockSpec(memory_space=pl.ANY),
                scratch_shapes=[pltpu.SemaphoreType.DMA((1,))]))(slot, new, k)

    sh = jax.sharding.SingleDeviceSharding(devices("v5e", 1)[0])
    a = lambda shape, dtype: S(shape, dtype, sharding=sh)
    with pytest.raises(Exception, match="aligned to tiles"):
        jax.jit(write, donate_argnums=0).lower(a((2, 2, 64, 16, 128), jnp.bfloat16),
                                               a((1, 2, 128), jnp.bfloat16),
                                               a((1,), jnp.int32)).compile()


def _cache_sized_copies(hlo: str, cache_elems: int) -> list[str]:
    """copy / transpose instructions in compiled HLO whose result holds >= a layer's cache."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*\w+\[([\d,]+)\]\{[^}]*\}\s+(copy|transpose)\(", line)
        if m and np.prod([int(x) for x in m.group(1).split(",")]) >= cache_elems:
            out.append(line.strip()[:200])
    return out


STEP_CASES = [pytest.param("tpu", 128, 1, jnp.bfloat16, id="tpu-d128-kv1-bf16")] + [
    pytest.param(impl, d, hkv, dt, id=f"{impl}-d{d}-kv{hkv}-{jnp.dtype(dt).name}",
                 marks=pytest.mark.exhaustive)
    for impl, (d, hkv, dt) in itertools.product(
        ("tpu", "reference"), [(64, 3, jnp.float32), (128, 1, jnp.bfloat16),
                               (128, 2, jnp.bfloat16)])
    if (impl, d, hkv, dt) != ("tpu", 128, 1, jnp.bfloat16)]


@pytest.mark.parametrize("impl,head_dim,kv_heads,dtype", STEP_CASES)
def test_engine_step_does_not_copy_the_cache(impl, head_dim, kv_heads, dtype):
    """The whole decode step on v5e with the cache's format pinned: no copy or transpose of a
    cache-sized buffer, and temporaries well under the cache."""
    require_compiler("v5e")
    from seer_jax.engine.attention_backend import AttentionPlan
    from seer_jax.engine.batch import Layout
    from seer_jax.engine.model_runner import _sample_step, cache_format, step_jit
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params
    from seer_jax.pallas.kv_layout import kv_cache_shape

    sh = jax.sharding.SingleDeviceSharding(devices("v5e", 1)[0])
    cfg = tiny_config(eos_token_ids=(), head_dim=head_dim, num_heads=3 * kv_heads,
                      num_kv_heads=kv_heads, num_layers=3, hidden_size=128,
                      dtype=jnp.dtype(dtype).name)
    params = jax.tree.map(lambda x: S(x.shape, x.dtype, sharding=sh),
                          jax.eval_shape(lambda: init_params(cfg, seed=0)))
    shape = kv_cache_shape(cfg.num_layers, 2048, 16, kv_heads, head_dim)
    kv = S(shape, dtype, sharding=sh)
    layout = Layout(n_dec=8, q_dec=1, n_pre=0, t_pre=0, pps=8)
    n = layout.n_dec
    i32, f32 = jnp.int32, jnp.float32
    batch = {k: S(s, t, sharding=sh) for k, (s, t) in {
        "tokens": ((n,), i32), "positions": ((n,), i32), "slots": ((n,), i32),
        "logits_index": ((n,), i32), "temperature": ((n,), f32), "top_p": ((n,), f32),
        "top_k": ((n,), i32), "seeds": ((n,), jnp.uint32), "gen_index": ((n,), i32),
        "dec_kv_lens": ((n,), i32), "dec_pages": ((n, layout.pps), i32),
        "dec_cu": ((n + 1,), i32), "dec_num": ((), i32)}.items()}
    plan = AttentionPlan(impl=impl, interpret=False, mesh=None, tp=1, kv_repeat=1)
    fmt = cache_format(sh)
    exe = step_jit(_sample_step, fmt, params, sh, cfg=cfg, layout=layout, plan=plan,
                   num_top=0).lower(params, kv, batch).compile()
    assert exe.input_formats[0][1].layout.major_to_minor == (0, 1, 2, 3, 4)
    layer_elems = int(np.prod(shape[1:]))
    assert not _cache_sized_copies(exe.as_text(), layer_elems)
    cache_bytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    mem = exe.memory_analysis()
    assert mem.temp_size_in_bytes < cache_bytes / 10, (mem.temp_size_in_bytes, cache_bytes)
