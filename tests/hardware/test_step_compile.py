"""Each shipped deployment config's engine step (decode, mixed prefill, verify of draft trees)
compiles for its own chip at its slice's tp, model shapes, page size, batch limits and KV cache,
with abstract parameters, and fits the device's HBM per the compiler: with the kernels
(impl=auto) and with the jnp reference (impl=reference)."""

import pathlib

import pytest

from seer_jax.config_files import load_config_file
from seer_jax.errors import ConfigError
from seer_jax.hardware.deploy import compile_config, config_target
from seer_jax.hardware.step import STEP_KINDS
from tests.hardware.compilers import require_compiler

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
DEPLOY = ("tpu_v5p64_qwen25_7b", "tpu_v6e32_llama3_8b", "gpu_8xh200", "gpu_4x8xh100_llama31_405b")

# The jnp reference attention runs long query regions in blocks of bounded scores, per shard
# (like the kernels) when the model has fewer KV heads than tp, and reads its gathered pages in
# the cache's own row-major layout, so every step reads the cache as it lies.


def _cases():
    out = []
    for name in DEPLOY:
        for impl in ("auto", "reference"):
            for kind in STEP_KINDS:
                # CI time: the GPU configs' reference steps run with the exhaustive set
                marks = [pytest.mark.exhaustive] if impl == "reference" and name.startswith("gpu") else []
                out.append(pytest.param(name, impl, kind, id=f"{name}-{impl}-{kind}", marks=marks))
    return out


@pytest.mark.parametrize("name,impl,kind", _cases())
def test_deploy_step_compiles_and_fits(name, impl, kind):
    c = load_config_file(CONFIGS / f"{name}.py")
    require_compiler(config_target(c).name)
    (mem,) = compile_config(c, impl, (kind,))
    assert mem.fits and mem.peak_bytes > mem.weight_bytes + mem.kv_bytes
    # the compiler sees the weights and cache we think it holds (batch arrays are small)
    assert mem.argument_bytes >= mem.weight_bytes + mem.kv_bytes
    assert mem.argument_bytes < 1.05 * (mem.weight_bytes + mem.kv_bytes) + 2**30


def test_a_step_that_does_not_fit_names_config_bytes_and_chip():
    """Weights + KV fit the declared budget (validate_config passes) but the compiled step's
    batch and temporaries do not: the compiler's numbers catch it."""
    c = load_config_file(CONFIGS / "gpu_8xh200.py")
    require_compiler("h200")
    c.mesh.hbm_gib_per_device = 87.2  # per device: 7.09 GiB of weights + 80 GiB of KV
    with pytest.raises(ConfigError, match=r"config 'gpu_8xh200_qwen25_7b': the decode step .* needs "
                       r"[\d.]+ GiB per device per the compiler .* more than the 87\.20 GiB of "
                       r"HBM per h200 device"):
        compile_config(c, "auto", ("decode",))
