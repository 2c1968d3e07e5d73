"""The expert MLP of a mixture-of-experts layer compiles with the target's own compiler for TPU
v5e, v5p, v6e and H100 at the MoE deployment configs' per-slice shapes (experts split over tp):
a decode-sized batch (every local expert over every token, `moe.dense_experts`; at batch 1 only
the chosen experts, `moe.sparse_experts` through the expert GEMM kernel, whose bytes are
checked) and a prefill-sized one (`grouped_matmul.blocked_experts` with the expert GEMM kernel:
Mosaic on TPU, `pallas.expert_gemm_tpu`; Triton on GPU, `pallas.expert_gemm_gpu`), with the
router, the dispatch (psum over tp, or the ragged all-to-all where it sends fewer bytes: top-8
over 8 or 16 devices) and the combine. The blocked grouped matmul's loop of batched matmuls
alone compiles for every target at those shapes too, and the kernels alone for every chip at
every slice's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seer_jax.hardware.targets import devices, get_target
from seer_jax.model.grouped_matmul import blocked_experts
from seer_jax.model.moe import MOE_AXES, moe_mlp, moe_shapes
from seer_jax.model.moe_config import MoeConfig
from seer_jax.model.sharding import ShardingRules, partition_spec
from tests.hardware.compilers import require_compiler

# (hidden, experts, top-k, expert intermediate) of the configs' models
MODELS = {"qwen3-30b-a3b": (2048, 128, 8, 768), "qwen3-235b-a22b": (4096, 128, 8, 1536)}


def _compile(model: str, target: str, tp: int, tokens: int):
    d, E, k, f = MODELS[model]
    moe = MoeConfig(num_experts=E, num_experts_per_tok=k, expert_intermediate_size=f,
                    norm_topk_prob=True)
    mesh = Mesh(np.array(devices(target, tp)), ("tp",))
    lp = {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(
        mesh, partition_spec(shape, MOE_AXES[name], mesh, ShardingRules())))
        for name, shape in moe_shapes(moe, d).items()}
    x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec()))
    fn = jax.jit(lambda x, lp: moe_mlp(x, lp, moe, mesh)[0])
    return fn.lower(x, lp).compile(), 3 * E // tp * d * f * 2


def _row_bytes(model: str, tokens: int) -> int:
    """Bytes of the (token, expert) rows of `tokens` tokens in bf16."""
    d, _, k, _ = MODELS[model]
    return tokens * k * d * 2


def _text(compiled, target: str) -> str:
    if get_target(target).platform == "tpu":
        return compiled.as_text()
    (module,) = compiled.runtime_executable().hlo_modules()
    return module.to_string()


CASES = [("qwen3-30b-a3b", t, tp) for t, tp in (("v5e", 4), ("v5p", 4), ("v6e", 4), ("h100", 2))]
CASES += [("qwen3-235b-a22b", t, tp) for t, tp in (("v5e", 16), ("v5p", 16), ("v6e", 16),
                                                   ("h100", 8))]
# CI: both sizes on H100 (the v5p configs' decode steps in test_step_compile run the
# decode-sized block on TPU; libtpu takes about a minute over the prefill-sized one); the
# exhaustive set compiles every case
DEFAULT = {("qwen3-30b-a3b", "h100", 2, 128), ("qwen3-30b-a3b", "h100", 2, 8192),
           ("qwen3-235b-a22b", "h100", 8, 8192)}


@pytest.mark.parametrize("model,target,tp,tokens", [
    pytest.param(*c, tokens, id=f"{c[0]}-{c[1]}-tp{c[2]}-{tokens}",
                 marks=[] if (*c, tokens) in DEFAULT else [pytest.mark.exhaustive])
    for c in CASES for tokens in (128, 8192)])
def test_expert_mlp_compiles(model, target, tp, tokens):
    require_compiler(target)
    compiled, expert_bytes = _compile(model, target, tp, tokens)
    text = _text(compiled, target)
    gpu = get_target(target).platform == "gpu"
    # decode-sized: dense_experts and the psum, no ragged op
    if tokens == 128:
        assert "ragged" not in text and "all-to-all" not in text
        return
    # prefill-sized: the ragged all-to-all where tp >= 8 (top-8), else the psum
    assert ("ragged-all-to-all" in text) == (tp >= 8)
    # the blocked grouped matmul's Pallas kernels (Mosaic or Triton calls; no ragged dot, no
    # loop gathering expert weights, no masked dense GEMM over every local expert):
    # temporaries of a few buffers of the (token, expert) rows, where the masked GEMM's are
    # local experts x those rows (16 GiB at H100 tp2)
    chip = "gpu" if gpu else "tpu"
    assert "ragged-dot" not in text and "while" not in text
    assert f"seer_expert_gate_up_{chip}" in text and f"seer_expert_down_{chip}" in text
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * _row_bytes(model, tokens)


@pytest.mark.parametrize("model,target,tp", [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-tp{c[2]}",
                 marks=[] if c[0] == "qwen3-30b-a3b" and c[1] in ("v5p", "h100")
                 else [pytest.mark.exhaustive])
    for c in CASES])
def test_single_token_reads_only_its_experts(model, target, tp):
    """Decode batch 1 (`moe.sparse_experts`, expert-parallel under the psum): the bytes the
    compiled expert MLP moves (attributed over its optimized module) are those of the experts
    the token chose, not of every local expert."""
    from seer_jax.hardware.hlo_bytes import attribute_bytes
    from seer_jax.pallas import cost_estimates

    require_compiler(target)
    d, E, k, f = MODELS[model]
    with cost_estimates.collect() as got:
        compiled, local_bytes = _compile(model, target, tp, 1)
    expert = 3 * d * f * 2
    # the expert GEMM kernel over the chosen experts' slots, counted by its estimate (TPU: in
    # the Mosaic call's config; GPU: as traced): the device's expected share of the k experts
    # (k / tp), weights read in place; beside it the float32 router, which XLA:GPU reads twice
    # (a product written out, then reduced)
    moved = attribute_bytes(_text(compiled, target),
                            {g.kernel: g.bytes_accessed for g in got}).total
    share = k / tp * expert
    router = d * E * 4
    assert share <= moved < 1.1 * share + 2 * router < local_bytes


@pytest.mark.exhaustive
@pytest.mark.parametrize("model,target,tp", [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-tp{c[2]}") for c in CASES])
def test_blocked_grouped_matmul_compiles(model, target, tp):
    """The blocked grouped matmul alone, one device's experts over a prefill chunk's 65,536
    (token, expert) rows, for every target."""
    require_compiler(target)
    d, E, k, f = MODELS[model]
    local, tokens = E // tp, 8192
    dev = devices(target, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    args = [jax.ShapeDtypeStruct(s, t, sharding=sharding) for s, t in (
        ((tokens, d), jnp.bfloat16), ((tokens, k), jnp.float32), ((tokens, k), jnp.int32),
        ((local, d, f), jnp.bfloat16), ((local, d, f), jnp.bfloat16), ((local, f, d), jnp.bfloat16))]
    compiled = jax.jit(blocked_experts).lower(*args).compile()
    assert "while" in _text(compiled, target)
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * _row_bytes(model, tokens)


@pytest.mark.parametrize("model,target,tp", [
    pytest.param(*c, id=f"{c[0]}-{c[1]}-tp{c[2]}") for c in CASES])
@pytest.mark.parametrize("tokens", [2048, 8192])
def test_expert_gemm_kernel_compiles(model, target, tp, tokens):
    """The Pallas expert GEMM kernels (Mosaic for the TPUs; Triton through ptxas for H100) at one
    slice's experts over a prefill chunk, with the block rows the engine picks; their estimates
    count the expert weights once per expected block, the real rows' activations and the flops
    of whole blocks."""
    from seer_jax.model.grouped_matmul import expected_blocks
    from seer_jax.pallas import cost_estimates, expert_gemm_gpu, expert_gemm_tpu

    require_compiler(target)
    d, E, k, f = MODELS[model]
    local = E // tp
    chip = get_target(target).platform
    sharding = jax.sharding.SingleDeviceSharding(devices(target, 1)[0])
    args = [jax.ShapeDtypeStruct(s, t, sharding=sharding) for s, t in (
        ((tokens, d), jnp.bfloat16), ((tokens, k), jnp.float32), ((tokens, k), jnp.int32),
        ((local, d, f), jnp.bfloat16), ((local, d, f), jnp.bfloat16), ((local, f, d), jnp.bfloat16))]
    impl = "tpu" if chip == "tpu" else "pallas"
    with cost_estimates.collect() as got:
        lowered = jax.jit(lambda *a: blocked_experts(*a, impl=impl, num_experts=E)).lower(*args)
    compiled = lowered.compile()
    text = _text(compiled, target)
    call = "tpu_custom_call" if chip == "tpu" else "__gpu$xla.gpu.triton"
    assert "while" not in text and text.count(f'custom_call_target="{call}"') == 2
    block = (expert_gemm_tpu if chip == "tpu" else expert_gemm_gpu).block_rows_for(
        tokens * k / E)
    blocks = expected_blocks(tokens, k, E, local, block)
    est = {g.kernel: g for g in got}
    weights = blocks * 3 * d * f * 2
    rows = tokens * k / tp  # the pairs of the slice's experts: padding rows are masked
    assert (est[f"seer_expert_gate_up_{chip}"].bytes_accessed
            + est[f"seer_expert_down_{chip}"].bytes_accessed) == pytest.approx(
        weights + rows * (2 * d + 2 * f) * 2, rel=1e-6)
    assert est[f"seer_expert_gate_up_{chip}"].flops == pytest.approx(
        2 * blocks * block * d * f * 2, rel=1e-6)
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * _row_bytes(model, tokens)
