"""The MLA kernels (latent write; absorbed attention over decode, mixed and tree batches)
compile with each target's own compiler (Mosaic; Triton + ptxas) at Moonlight-16B-A3B's and
Kimi-K2's per-device shapes: kv_lora_rank 512, qk_rope_head_dim 64, their query heads split over
tp (Moonlight 16 heads, Kimi-K2 64), the latent cache whole on every device. The default set is
a few cases on the chips each model is deployed on; `-m exhaustive` compiles every kernel for
every target, shard count, dtype and page size, and at a deployment's batch (128 sequences of up
to 4K tokens, the model's layers)."""

import pytest

from seer_jax.hardware.kernels import MLA_KERNELS, MlaCase, compile_mla_kernel
from tests.hardware.compilers import require_compiler

TARGETS = ("v5e", "v5p", "v6e", "h100", "h200")
# query heads per device: Moonlight's 16 over tp 1, 2, 4 and Kimi-K2's 64 over tp 2, 4, 8, 16
# give the same shapes (both: kv_lora_rank 512, qk_rope_head_dim 64), 4 to 32 heads in all
HEADS = (4, 8, 16, 32)


def _case(kernel, heads, dtype="bfloat16", page_size=16):
    return MlaCase(kernel, heads, 512, 64, dtype, page_size)


# Moonlight at tp 1 on v6e and H100; Kimi-K2 at tp 8 on v5p and H200
DEFAULT = [
    (_case("mla_write", 16), "v6e"),
    (_case("mla_decode", 16), "v6e"),
    (_case("mla_mixed", 16), "v6e"),
    (_case("mla_decode", 16), "h100"),
    (_case("mla_write", 8), "v5p"),
    (_case("mla_tree", 8), "v5p"),
    (_case("mla_write", 8), "h200"),
    (_case("mla_mixed", 8), "h200"),
]
# every kernel, head count and target in bf16 with 16-token pages; 64-token pages and f32 at
# the two models' default shards
EVERY = [(_case(k, h), t) for h in HEADS for k in MLA_KERNELS for t in TARGETS]
EVERY += [(_case(k, h, dt, s), t) for h in (8, 16) for dt, s in (("bfloat16", 64),
                                                                 ("float32", 16))
          for k in MLA_KERNELS for t in TARGETS]
# a deployment's batch: 128 sequences of up to 4K tokens, 512-token mixed steps, a 512K-token
# cache of the model's layers (Moonlight 27 at tp 1 on v6e / H100, Kimi-K2 61 at tp 8 on
# v5p / H200)
EVERY += [(MlaCase(k, h, 512, 64, "bfloat16", 16, num_layers=layers, num_pages=32768,
                   max_seqs=128, pages_per_seq=256, num_tokens=512), t)
          for h, layers, targets in ((16, 27, ("v6e", "h100")), (8, 61, ("v5p", "h200")))
          for k in MLA_KERNELS for t in targets]
EVERY = [c for c in EVERY if c not in DEFAULT]


def _params(cases):
    return [pytest.param(case, target, id=f"{case.label}-{target}") for case, target in cases]


@pytest.mark.parametrize("case,target", _params(DEFAULT))
def test_mla_kernels_compile_at_model_shapes(case, target):
    require_compiler(target)
    compile_mla_kernel(case, target)


@pytest.mark.exhaustive
@pytest.mark.parametrize("case,target", _params(EVERY))
def test_mla_kernels_compile_everywhere(case, target):
    require_compiler(target)
    compile_mla_kernel(case, target)


def test_mla_case_rejects_unknown_kernel():
    from seer_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="kernel"):
        MlaCase("mla_prefill", 16, 512, 64, "bfloat16", 16)


@pytest.mark.exhaustive  # 10-60 s each
@pytest.mark.parametrize("target, tp, kind", [("v6e", 1, "decode"), ("v6e", 2, "verify"),
                                              ("h100", 1, "decode"), ("h100", 1, "verify")])
def test_engine_step_of_a_latent_attention_model_compiles(target, tp, kind):
    """The engine's own step (`model_runner`) for a DeepSeek-V3-shaped model (latent cache,
    absorbed attention by the target's kernel, the MoE block) compiles for the chip; its cache
    is the latent rows, whole on every shard."""
    import dataclasses

    from seer_jax.hardware.step import StepLimits, compile_step
    from seer_jax.model.config import tiny_deepseek_config

    require_compiler(target)
    base = tiny_deepseek_config()
    cfg = tiny_deepseek_config(num_heads=8, num_kv_heads=8, head_dim=16 + 64, dtype="bfloat16",
                               mla=dataclasses.replace(base.mla, kv_lora_rank=128,
                                                       qk_rope_head_dim=64))
    lim = StepLimits(page_size=16, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64,
                     max_prefill_seqs=2, max_model_len=256)
    step = compile_step(cfg, target, tp, lim, kind)
    assert step.impl == {"v6e": "tpu", "h100": "gpu"}[target]
    assert step.kv_bytes == 3 * 64 * 16 * (128 + 64) * 2  # layers x pages x rows x width x bf16
