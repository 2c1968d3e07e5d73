"""Compile targets: the accelerators this package compiles for on a host without them.

JAX compiles ahead of time for hardware that is not attached: TPU topologies through libtpu's
compiler (Mosaic included), NVIDIA GPUs from a device description through XLA:GPU (Triton and
ptxas included). What compiles here compiles on the device, and the compiled executable's
`memory_analysis()` / `cost_analysis()` are the compiler's own per-device numbers.

Needs `pip install "jax[tpu]==<jax version>" "jax[cuda12]==<jax version>" absl-py` (`make
test-hardware` builds such an environment); `compilers_missing()` says what is absent.

Chip numbers (peak FLOP/s, HBM bandwidth and capacity) come from `seer_jax.costs.ACCELERATORS`,
the same presets the simulator's roofline uses. The GPU device descriptions in `gpu_specs/` are
`stream_executor.GpuTargetConfigProto` text protos derived from openxla/xla
`xla/backends/gpu/target_config/specs/h100_sxm.txtpb` (commit
0774019d97e77dc433ce97604295f6fc0f5b3b65) and `h200.txtpb` (commit
4336d12e0706168f6a382ddb231f3a83853b0657), Apache-2.0, without the unit rate tables and
`collective_memory_granularity` (unknown to jaxlib 0.10.2's proto).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import pathlib

from seer_jax.costs import ACCELERATORS, AcceleratorSpec
from seer_jax.errors import ConfigError

SPECS_DIR = pathlib.Path(__file__).resolve().parent / "gpu_specs"


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator kind. TPU: libtpu's name (`v5p`) and its chips per host bounds; GPU: the
    device description file. `accelerator` keys `seer_jax.costs.ACCELERATORS`."""

    name: str
    platform: str  # "tpu" | "gpu"
    accelerator: str
    tpu_name: str = ""  # libtpu topology prefix
    tpu_dims: int = 0  # 2 (v5e, v6e: AxB) or 3 (v5p: AxBxC)
    gpu_spec: str = ""  # file in gpu_specs/
    gpus_per_host: int = 8

    @property
    def spec(self) -> AcceleratorSpec:
        return ACCELERATORS[self.accelerator]

    def topology_name(self, num_devices: int) -> str:
        """The smallest topology holding `num_devices` chips (TPU: libtpu's `v5p:2x2x1` form;
        GPU: `slices x hosts x gpus per host`)."""
        if num_devices < 1:
            raise ConfigError(f"target {self.name}: num_devices={num_devices} must be >= 1")
        if self.platform == "gpu":
            per_host = min(num_devices, self.gpus_per_host)
            if num_devices % per_host:
                raise ConfigError(f"target {self.name}: {num_devices} GPUs do not fill hosts of "
                                  f"{self.gpus_per_host}")
            return f"1x{num_devices // per_host}x{per_host}"
        # TPU hosts hold 2x2 chips; grow the last free axis by doubling
        dims = [2, 2] + ([1] if self.tpu_dims == 3 else [])
        axis = len(dims) - 1
        while _prod(dims) < num_devices:
            dims[axis] *= 2
            axis = (axis - 1) % len(dims)
        return f"{self.tpu_name}:{'x'.join(map(str, dims))}"


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


TARGETS: dict[str, Target] = {
    "v5e": Target("v5e", "tpu", "tpu-v5e", tpu_name="v5e", tpu_dims=2),
    "v5p": Target("v5p", "tpu", "tpu-v5p", tpu_name="v5p", tpu_dims=3),
    "v6e": Target("v6e", "tpu", "tpu-v6e", tpu_name="v6e", tpu_dims=2),
    "h100": Target("h100", "gpu", "h100", gpu_spec="h100_sxm.txtpb"),
    "h200": Target("h200", "gpu", "h200", gpu_spec="h200.txtpb"),
}


def get_target(name: str) -> Target:
    key = name.strip().lower().replace("tpu-", "").replace("tpu_", "")
    if key not in TARGETS:
        raise ConfigError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[key]


def _install_hint(what: str) -> str:
    import importlib.metadata

    jax_version = importlib.metadata.version("jax")
    return (f"install the compilers with pip install 'seer-jax[hardware]' (from a checkout: pip "
            f"install -e '.[hardware]'; about 6.5 GB), or only this platform's: pip install "
            f"{what.format(jax=jax_version)}")


def compilers_missing(platform: str) -> str:
    """'' when this environment can compile for `platform` ("tpu" | "gpu"), else why not and
    how to install what is missing."""
    if platform == "tpu":
        if importlib.util.find_spec("libtpu") is None:
            return "libtpu is not installed; " + _install_hint("'jax[tpu]=={jax}'")
        return ""
    if platform == "gpu":
        missing = [m for m in ("jax_cuda12_plugin", "absl") if importlib.util.find_spec(m) is None]
        if missing:
            return (f"{', '.join(missing)} not installed; "
                    + _install_hint("'jax[cuda12]=={jax}' absl-py"))
        return ""
    raise ConfigError(f"platform={platform!r}; allowed: tpu, gpu")


@functools.cache
def devices(target_name: str, num_devices: int) -> tuple:
    """`num_devices` compile-only devices of the target (the first ones of the smallest
    topology holding them). Needs the target platform's compiler (`compilers_missing`)."""
    target = get_target(target_name)
    problem = compilers_missing(target.platform)
    if problem:
        raise ConfigError(f"cannot compile for {target.name}: {problem}")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server on this host
    # compile-only: several processes (pytest -n) may load libtpu at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    name = target.topology_name(num_devices)
    if target.platform == "tpu":
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name)
    else:
        spec = (SPECS_DIR / target.gpu_spec).read_text()
        topo = topologies.get_topology_desc(platform="cuda", topology=name, target_config=spec)
    return tuple(topo.devices[:num_devices])
