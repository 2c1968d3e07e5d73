"""Every kernel compiles with the target's own compiler (Mosaic on TPU, Triton + ptxas on GPU)
for TPU v5e, v5p, v6e and H100, at the shipped models' per-shard shapes and a corner of the
product (the default set), and over the whole product of GQA group, head_dim, dtype and page
size (`-m exhaustive`)."""

import itertools

import pytest

from seer_jax.hardware.kernels import KERNELS, KernelCase, compile_kernel, model_case
from tests.hardware.compilers import require_compiler

TARGETS = ("v5e", "v5p", "v6e", "h100")

# (name, num_heads, num_kv_heads, head_dim, tp, page_size, dtype) as the configs serve them
SHIPPED = {
    "smollm2": (9, 3, 64, 1, 16, "float32"),
    "qwen2.5-7b-tp4": (28, 4, 128, 4, 64, "bfloat16"),
    "qwen2.5-7b-tp2": (28, 4, 128, 2, 16, "bfloat16"),
    "llama3-8b-tp4": (32, 8, 128, 4, 64, "bfloat16"),
    "llama3.1-405b-tp16": (128, 8, 128, 16, 16, "bfloat16"),
}


def _params(cases):
    return [pytest.param(case, target, id=f"{case.label}-{target}") for case, target in cases]


def _run(case: KernelCase, target: str) -> None:
    require_compiler(target)
    compile_kernel(case, target)


# the default model (every target) and each deployment's shapes on its own chip family (H100
# for the GPU ones); the exhaustive set compiles every shipped shape for every target
SHIPPED_ON = {"smollm2": TARGETS, "qwen2.5-7b-tp4": ("v5p",), "qwen2.5-7b-tp2": ("h100",),
              "llama3-8b-tp4": ("v6e",), "llama3.1-405b-tp16": ("h100",)}


def _shipped(targets_of):
    return [(model_case(k, num_heads=hq, num_kv_heads=hkv, head_dim=d, tp=tp, dtype=dt,
                        page_size=page), t)
            for name, (hq, hkv, d, tp, page, dt) in SHIPPED.items() for k in KERNELS
            for t in targets_of(name)]


SHIPPED_CASES = _shipped(SHIPPED_ON.__getitem__)
SHIPPED_ELSEWHERE = [c for c in _shipped(lambda name: TARGETS) if c not in SHIPPED_CASES]
# a corner of the product: the smallest and largest GQA group, both head_dims and both dtypes,
# as four combinations that hold every pair of those three factors (the product has the rest)
CORNERS = [(1, 64, "bfloat16"), (1, 128, "float32"), (10, 64, "float32"), (10, 128, "bfloat16")]
# on one TPU generation and H100 (the shipped shapes compile on all three TPU generations)
CORNER_CASES = [(KernelCase(k, 2 * g, 2, d, dt, 16), t) for g, d, dt in CORNERS
                for k in KERNELS for t in ("v5e", "h100")]
PRODUCT_CASES = [(KernelCase(k, 2 * g, 2, d, dt, s), t) for g, d, dt, s in itertools.product(
    range(1, 11), (64, 128), ("bfloat16", "float32"), (16, 64)) for k in KERNELS for t in TARGETS]


@pytest.mark.parametrize("case,target", _params(SHIPPED_CASES))
def test_shipped_model_kernels_compile(case, target):
    _run(case, target)


@pytest.mark.exhaustive
@pytest.mark.parametrize("case,target", _params(SHIPPED_ELSEWHERE))
def test_shipped_model_kernels_compile_on_every_target(case, target):
    _run(case, target)


@pytest.mark.parametrize("case,target", _params(CORNER_CASES))
def test_kernel_grid_corners_compile(case, target):
    _run(case, target)


@pytest.mark.exhaustive
@pytest.mark.parametrize("case,target", _params(PRODUCT_CASES))
def test_kernel_product_compiles(case, target):
    _run(case, target)


@pytest.mark.parametrize("target", ["v5e", "h100"])
@pytest.mark.parametrize("kernel", ["decode", "mixed", "tree"])
def test_attention_compiles_under_highest_matmul_precision(kernel, target):
    """A process-wide jax_default_matmul_precision="highest" (as in this test suite) does not
    reach the kernels' dots: bfloat16 and float32 attention compile under it."""
    require_compiler(target)
    for dtype in ("bfloat16", "float32"):
        compile_kernel(KernelCase(kernel, 8, 2, 128, dtype, 16), target, "highest")
