"""Every public kernel lowers for TPU (Mosaic) and GPU (Triton) from this CPU-only host.

`jax.export` runs the real Pallas lowering for the target platform without a device: Mosaic's
block-shape rules (last two block dims divisible by (8, 128) or whole) and the Mosaic GPU shared
memory check both fire here. Shapes are the per-shard head layouts of the model families the
deployment configs ship, at tp 1/2/4/8.
"""

from __future__ import annotations

import itertools
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax import export

from seer_jax.config_files import load_config_file
from seer_jax.engine.attention_backend import AttentionPlan, check_kernel_shapes
from seer_jax.integrations.deploy_config import engine_config, model_config
from seer_jax.pallas import ragged_paged_attention, write_kv

ROOT = pathlib.Path(__file__).resolve().parents[2]

PLATFORMS = {"tpu": "tpu", "gpu": "cuda"}
# Triton kernels are not on jax's list of custom calls with a stability guarantee.
DISABLED = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]

# (family, q heads, KV heads, head_dim) of the whole model; per-shard layouts follow from tp.
MODELS = [
    ("smollm2", 9, 3, 64),
    ("llama3_8b", 32, 8, 128),
    ("qwen25_7b", 28, 4, 128),
    ("qwen3_8b", 32, 8, 128),
    ("qwen3_0p6b", 16, 8, 128),
]


def shard_layouts() -> list[tuple[str, int, int, int]]:
    """(id, q heads, KV heads, head_dim) per shard for every (model, tp) that splits evenly;
    fewer KV heads than shards means each shard holds one (replicated) KV head."""
    out, seen = [], set()
    for (name, hq, hkv, d), tp in itertools.product(MODELS, (1, 2, 4, 8)):
        if hq % tp:
            continue
        layout = (hq // tp, max(1, hkv // tp), d)
        if layout not in seen:
            seen.add(layout)
            out.append((f"{name}-tp{tp}", *layout))
    return out


LAYOUTS = shard_layouts()
BATCHES = {  # kind -> (num_tokens, max_seqs, tree)
    "decode": (64, 64, False),
    "mixed": (96, 8, False),
    "tree": (48, 8, True),
}
S = jax.ShapeDtypeStruct


def _attention_args(hq, hkv, d, dtype, page_size, kind, layered):
    num_tokens, max_seqs, tree = BATCHES[kind]
    pages, pps, layers = 64, 8, 3
    pool = (pages, page_size, 2 * hkv, d)
    pool = (layers,) + pool if layered else pool
    args = [S((num_tokens, hq, d), dtype), S(pool, dtype),
            S((max_seqs,), jnp.int32), S((max_seqs, pps), jnp.int32),
            S((max_seqs + 1,), jnp.int32), S((), jnp.int32)]
    if tree:
        args.append(S((num_tokens,), jnp.int32))
    if layered:
        args.append(S((), jnp.int32))
    return args, tree


def lower_attention(impl, hq, hkv, d, dtype, page_size, kind, layered=False):
    args, tree = _attention_args(hq, hkv, d, dtype, page_size, kind, layered)

    def f(q, kv, kv_lens, pages, cu, n, *rest):
        rest = list(rest)
        tp = rest.pop(0) if tree else None
        extra = {"layer": rest.pop(0)} if layered else {}
        return ragged_paged_attention(q, kv, kv_lens, pages, cu, n, tree_parents=tp,
                                      impl=impl, **extra)

    return export.export(jax.jit(f), platforms=[PLATFORMS[impl]], disabled_checks=DISABLED)(*args)


def lower_write_kv(impl, hkv, d, dtype, page_size, num_tokens, layered=False):
    pool = (64, page_size, 2 * hkv, d)
    pool = (3,) + pool if layered else pool
    args = [S(pool, dtype), S((num_tokens, hkv, d), dtype), S((num_tokens, hkv, d), dtype),
            S((num_tokens,), jnp.int32)]
    if layered:
        args.append(S((), jnp.int32))

    def f(kv, nk, nv, slots, *layer):
        return write_kv(kv, nk, nv, slots, impl=impl, **({"layer": layer[0]} if layer else {}))

    return export.export(jax.jit(f, donate_argnums=0), platforms=[PLATFORMS[impl]],
                         disabled_checks=DISABLED)(*args)


def _representative():
    """Each layout on both platforms, with dtype, page size and batch kind rotating so every
    value of each axis meets several groups."""
    dtypes = (jnp.bfloat16, jnp.float32)
    pages = (16, 32, 64)
    kinds = tuple(BATCHES)
    out = []
    for i, (name, hq, hkv, d) in enumerate(LAYOUTS):
        for impl in PLATFORMS:
            j = i + (impl == "gpu")
            out.append(pytest.param(impl, hq, hkv, d, dtypes[j % 2], pages[j % 3], kinds[j % 3],
                                    id=f"{impl}-{name}-{kinds[j % 3]}"))
    return out


@pytest.mark.parametrize("impl,hq,hkv,d,dtype,page_size,kind", _representative())
def test_attention_lowers(impl, hq, hkv, d, dtype, page_size, kind):
    exp = lower_attention(impl, hq, hkv, d, dtype, page_size, kind)
    assert "custom_call" in exp.mlir_module()


@pytest.mark.parametrize("impl", list(PLATFORMS))
@pytest.mark.parametrize("group", [5, 6, 7, 9])
def test_attention_lowers_for_odd_gqa_groups(impl, group):
    # Qwen2.5-7B (28/4 = 7) and friends: q row blocks must still be whole tiles.
    for dtype in (jnp.bfloat16, jnp.float32):
        lower_attention(impl, group * 2, 2, 128, dtype, 16, "mixed")


@pytest.mark.parametrize("impl", list(PLATFORMS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("hkv,d", [(3, 64), (8, 128), (1, 128)])
def test_write_kv_lowers(impl, dtype, hkv, d):
    for num_tokens in (1, 40):
        lower_write_kv(impl, hkv, d, dtype, 16, num_tokens)


@pytest.mark.parametrize("impl", list(PLATFORMS))
def test_layered_cache_lowers_without_slicing_the_pool(impl):
    # The engine passes the whole [L, P, S, 2 * Hkv, D] cache and a layer index: the lowered
    # module must hand the full cache to the kernel, never a [P, S, 2 * Hkv, D] slice of it.
    hq, hkv, d, ps = 8, 2, 128, 16
    att = lower_attention(impl, hq, hkv, d, jnp.bfloat16, ps, "decode", layered=True)
    kvw = lower_write_kv(impl, hkv, d, jnp.bfloat16, ps, 8, layered=True)
    layer_pool = f"tensor<64x{ps}x{2 * hkv}x{d}xbf16>"
    for exp in (att, kvw):
        text = exp.mlir_module()
        assert f"tensor<3x64x{ps}x{2 * hkv}x{d}xbf16>" in text
        assert layer_pool not in text, "a per-layer slice of the pool appears in the module"


@pytest.mark.slow
@pytest.mark.exhaustive  # minutes per platform: make test-all runs it
@pytest.mark.parametrize("impl", list(PLATFORMS))
def test_attention_lowers_exhaustive(impl):
    """Every layout x dtype x page size x batch kind (about 200 lowerings per platform)."""
    for (_, hq, hkv, d), dtype, ps, kind in itertools.product(
            LAYOUTS, (jnp.bfloat16, jnp.float32), (16, 32, 64), tuple(BATCHES)):
        lower_attention(impl, hq, hkv, d, dtype, ps, kind)


DEPLOY_CONFIGS = sorted(p for p in (ROOT / "configs").glob("*.py")
                        if "c.platform" in p.read_text())


@pytest.mark.parametrize("path", DEPLOY_CONFIGS, ids=lambda p: p.stem)
def test_deployment_configs_lower_at_their_shapes(path):
    """Each shipped deployment config: the engine accepts its kernel impl at build time, and both
    kernels lower for its platform at its per-shard heads, page size, dtype, page-table width
    and full per-device pool (the GPU pool exceeds 4 GiB: 64-bit offsets)."""
    c = load_config_file(path)
    cfg, eng = model_config(c), engine_config(c)
    impl = "tpu" if c.platform == "tpu" else "gpu"
    tp = c.mesh.tp
    if cfg.mla is not None:
        return _lower_latent_config(cfg, eng, impl, tp)
    hq, hkv = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
    dtype = jnp.dtype(cfg.dtype)
    pps = -(-(eng.max_model_len or cfg.max_position_embeddings) // eng.page_size)
    plan = AttentionPlan(impl=impl, interpret=False, mesh=None, tp=tp,
                         kv_repeat=max(1, tp // cfg.num_kv_heads))
    check_kernel_shapes(plan, cfg, page_size=eng.page_size, dtype_bytes=dtype.itemsize,
                        max_seqs=eng.max_num_seqs, pages_per_seq=pps,
                        max_tokens=eng.max_num_batched_tokens)
    pages = int(eng.kv_pages(cfg.kv_bytes_per_token()) // tp)
    pool = S((cfg.num_layers, pages, eng.page_size, 2 * hkv, cfg.head_dim), dtype)
    n = eng.max_num_seqs
    meta = [S((n,), jnp.int32), S((n, pps), jnp.int32), S((n + 1,), jnp.int32), S((), jnp.int32)]

    def attend(q, kv, a, b, cu, num, layer):
        return ragged_paged_attention(q, kv, a, b, cu, num, impl=impl, layer=layer)

    def write(kv, nk, nv, slots, layer):
        return write_kv(kv, nk, nv, slots, impl=impl, layer=layer)

    plat = [PLATFORMS[impl]]
    export.export(jax.jit(attend), platforms=plat, disabled_checks=DISABLED)(
        S((n, hq, cfg.head_dim), dtype), pool, *meta, S((), jnp.int32))
    t = 512
    export.export(jax.jit(write, donate_argnums=0), platforms=plat, disabled_checks=DISABLED)(
        pool, S((t, hkv, cfg.head_dim), dtype), S((t, hkv, cfg.head_dim), dtype),
        S((t,), jnp.int32), S((), jnp.int32))


def _lower_latent_config(cfg, eng, impl: str, tp: int) -> None:
    """A latent-attention config: the engine accepts its MLA kernels, which lower for its
    platform at its per-shard heads and the whole latent cache (every shard holds it)."""
    from seer_jax.engine.mla_backend import check_mla_kernel_shapes
    from seer_jax.pallas.mla import ragged_paged_mla_attention
    from seer_jax.pallas.mla_layout import latent_cache_shape
    from seer_jax.pallas.mla_write import write_latent

    m, dtype = cfg.mla, jnp.dtype(cfg.dtype)
    pps = -(-(eng.max_model_len or cfg.max_position_embeddings) // eng.page_size)
    plan = AttentionPlan(impl=impl, interpret=False, mesh=None, tp=tp, kv_repeat=1)
    check_mla_kernel_shapes(plan, num_heads=cfg.num_heads, kv_lora_rank=m.kv_lora_rank,
                            rope_dim=m.qk_rope_head_dim, page_size=eng.page_size,
                            dtype_bytes=dtype.itemsize, max_seqs=eng.max_num_seqs,
                            pages_per_seq=pps, max_tokens=eng.max_num_batched_tokens)
    pages = int(eng.kv_pages(cfg.kv_bytes_per_token()))
    pool = S(latent_cache_shape(cfg.num_layers, pages, eng.page_size, m.kv_lora_rank,
                                m.qk_rope_head_dim), dtype)
    n, heads = eng.max_num_seqs, cfg.num_heads // tp
    meta = [S((n,), jnp.int32), S((n, pps), jnp.int32), S((n + 1,), jnp.int32), S((), jnp.int32)]

    def attend(ql, qr, cache, a, b, cu, num, layer):
        return ragged_paged_mla_attention(ql, qr, cache, a, b, cu, num, sm_scale=0.1, impl=impl,
                                          layer=layer)

    def write(cache, c_kv, k_rope, slots, layer):
        return write_latent(cache, c_kv, k_rope, slots, impl=impl, layer=layer)

    plat = [PLATFORMS[impl]]
    export.export(jax.jit(attend), platforms=plat, disabled_checks=DISABLED)(
        S((n, heads, m.kv_lora_rank), dtype), S((n, heads, m.qk_rope_head_dim), dtype), pool,
        *meta, S((), jnp.int32))
    t = 512
    export.export(jax.jit(write, donate_argnums=0), platforms=plat, disabled_checks=DISABLED)(
        pool, S((t, m.kv_lora_rank), dtype), S((t, m.qk_rope_head_dim), dtype),
        S((t,), jnp.int32), S((), jnp.int32))
