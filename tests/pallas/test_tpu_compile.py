"""The TPU kernels compile (Mosaic included) for v5e, v5p and v6e, deviceless, from this host.

`jax.export` stops before Mosaic's compiler runs; compiling for a TPU topology description runs
libtpu's whole compiler, so what compiles here compiles on the chip. Needs libtpu
(`pip install "jax[tpu]==<jax version>"`); the test skips without it. Run it in a process that
has not initialised another backend with TPU disabled: JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1.

Covered: the KV write at every page size 8..128, head_dim 64 and 128, bf16 and f32 (the old
[.., page_size, head_dim] page layout put the per-token DMA offset on a tiled dimension, which
Mosaic refuses for bf16); attention for decode, mixed and tree batches; and the whole engine
step, whose compiled HLO must not copy or transpose the cache (its device layout is pinned).
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                reason="libtpu is not installed (pip install 'jax[tpu]==<jax "
                                       "version>' to compile for TPU without one)")

TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def tpu_devices():
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    try:
        return {name: topologies.get_topology_desc(platform="tpu", topology_name=topo).devices[0]
                for name, topo in TOPOLOGIES.items()}
    except Exception as e:  # noqa: BLE001 - any failure to build a topology means: cannot run
        pytest.skip(f"no TPU topology description from libtpu: {e}")


def _on(dev):
    sh = jax.sharding.SingleDeviceSharding(dev)
    return lambda shape, dtype: S(shape, dtype, sharding=sh)


def compile_write(dev, dtype, hkv, head_dim, page_size, num_tokens=24, layers=2, pages=64):
    from seer_jax.pallas import write_kv

    a = _on(dev)
    f = jax.jit(lambda kv, nk, nv, s, li: write_kv(kv, nk, nv, s, impl="tpu", layer=li),
                donate_argnums=0)
    return f.lower(a((layers, pages, page_size, 2 * hkv, head_dim), dtype),
                   a((num_tokens, hkv, head_dim), dtype), a((num_tokens, hkv, head_dim), dtype),
                   a((num_tokens,), jnp.int32), a((), jnp.int32)).compile()


def compile_attention(dev, kind, dtype, hq, hkv, head_dim, page_size, max_seqs=8, pps=16):
    from seer_jax.pallas import ragged_paged_attention

    a = _on(dev)
    n = {"decode": max_seqs, "mixed": 64, "tree": 4 * max_seqs}[kind]
    args = [a((n, hq, head_dim), dtype), a((2, 128, page_size, 2 * hkv, head_dim), dtype),
            a((max_seqs,), jnp.int32), a((max_seqs, pps), jnp.int32),
            a((max_seqs + 1,), jnp.int32), a((), jnp.int32), a((), jnp.int32)]
    tree = kind == "tree"
    if tree:
        args.append(a((n,), jnp.int32))

    def f(q, kv, lens, table, cu, num, layer, *parents):
        return ragged_paged_attention(q, kv, lens, table, cu, num, impl="tpu", layer=layer,
                                      tree_parents=parents[0] if tree else None)

    return jax.jit(f).lower(*args).compile()


@pytest.mark.parametrize("target", list(TOPOLOGIES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_write_kv_compiles(tpu_devices, target, dtype):
    for page_size, head_dim, hkv in [(8, 64, 3), (16, 128, 1), (32, 128, 2), (128, 64, 8)]:
        compile_write(tpu_devices[target], dtype, hkv, head_dim, page_size)


@pytest.mark.parametrize("target", list(TOPOLOGIES))
@pytest.mark.parametrize("kind", ["decode", "mixed", "tree"])
def test_attention_compiles(tpu_devices, target, kind):
    # GQA 7 at one KV head per shard (Qwen2.5-7B at tp 4), GQA 3 at three (SmolLM2), GQA 4 at 2
    for (hq, hkv, head_dim), dtype in itertools.product(
            [(7, 1, 128), (9, 3, 64), (8, 2, 128)], [jnp.bfloat16, jnp.float32]):
        compile_attention(tpu_devices[target], kind, dtype, hq, hkv, head_dim, 16)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TOPOLOGIES))
def test_kernels_compile_exhaustive(tpu_devices, target):
    """Page sizes 8..128 x head_dim x dtype x KV heads for the write; GQA groups 1..10 for
    attention."""
    dev = tpu_devices[target]
    for dtype, ps, d, hkv in itertools.product((jnp.bfloat16, jnp.float32), (8, 16, 32, 64, 128),
                                               (64, 128), (1, 2, 3, 4, 8)):
        compile_write(dev, dtype, hkv, d, ps)
    for kind, dtype, group, d in itertools.product(("decode", "mixed", "tree"),
                                                   (jnp.bfloat16, jnp.float32), range(1, 11),
                                                   (64, 128)):
        compile_attention(dev, kind, dtype, 2 * group, 2, d, 16)


def test_old_page_layout_write_does_not_compile(tpu_devices):
    """The check has teeth: a per-token DMA at a dynamic page offset into a
    [.., page_size, head_dim] page (the layout this cache replaced) fails in bf16."""
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

    a = _on(tpu_devices["v5e"])
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


@pytest.mark.parametrize("impl", ["tpu", "reference"])
@pytest.mark.parametrize("head_dim,kv_heads,dtype", [(64, 3, jnp.float32), (128, 1, jnp.bfloat16),
                                                     (128, 2, jnp.bfloat16)])
def test_engine_step_does_not_copy_the_cache(tpu_devices, impl, head_dim, kv_heads, dtype):
    """The whole decode step on v5e with the cache's format pinned: no copy or transpose of a
    cache-sized buffer, and temporaries well under the cache."""
    from seer_jax.engine.attention_backend import AttentionPlan
    from seer_jax.engine.batch import Layout
    from seer_jax.engine.model_runner import _sample_step, cache_format, step_jit
    from seer_jax.model.config import tiny_config
    from seer_jax.model.llama import init_params
    from seer_jax.pallas.kv_layout import kv_cache_shape

    dev = tpu_devices["v5e"]
    sh = jax.sharding.SingleDeviceSharding(dev)
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
