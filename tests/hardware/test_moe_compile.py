"""The expert MLP of a mixture-of-experts layer compiles with the target's own compiler for TPU
v5e, v5p, v6e and H100 at the MoE deployment configs' per-slice shapes (experts split over tp):
a decode-sized batch (every local expert over every token, `moe.dense_experts`) and a
prefill-sized one (the grouped `ragged_dot`), with the router, the psum over tp and the shared
combine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seer_jax.hardware.targets import devices, get_target
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
DEFAULT = {("qwen3-30b-a3b", "h100", 2, 128), ("qwen3-30b-a3b", "h100", 2, 8192)}


@pytest.mark.parametrize("model,target,tp,tokens", [
    pytest.param(*c, tokens, id=f"{c[0]}-{c[1]}-tp{c[2]}-{tokens}",
                 marks=[] if (*c, tokens) in DEFAULT else [pytest.mark.exhaustive])
    for c in CASES for tokens in (128, 8192)])
def test_expert_mlp_compiles(model, target, tp, tokens):
    require_compiler(target)
    compiled, expert_bytes = _compile(model, target, tp, tokens)
    text = _text(compiled, target)
    # decode-sized: dense_experts, no ragged dot; prefill-sized: the grouped ragged_dot (on
    # GPU, which lowers it to a masked GEMM, a gemm fusion)
    if tokens == 128:
        assert "ragged" not in text
    else:
        assert "ragged" in text or "gemm_fusion" in text
    assert expert_bytes > 0
