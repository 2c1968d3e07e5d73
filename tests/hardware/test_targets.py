"""The compile-target registry (no compiler needed)."""

import pytest

from seer_jax.costs import ACCELERATORS
from seer_jax.errors import ConfigError
from seer_jax.hardware.targets import TARGETS, compilers_missing, get_target


def test_targets_reuse_the_cost_models_chip_specs():
    assert set(TARGETS) == {"v5e", "v5p", "v6e", "h100", "h200"}
    for t in TARGETS.values():
        assert t.spec is ACCELERATORS[t.accelerator]
    assert get_target("tpu-v5p") is TARGETS["v5p"] and get_target("H100") is TARGETS["h100"]


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown compile target 'v7x'; known: v5e, v5p, v6e, "
                       "h100, h200"):
        get_target("v7x")
    with pytest.raises(ConfigError, match="platform='rocm'; allowed: tpu, gpu"):
        compilers_missing("rocm")


@pytest.mark.parametrize("name,n,topology", [
    ("v5e", 1, "v5e:2x2"), ("v5e", 4, "v5e:2x2"), ("v6e", 8, "v6e:2x4"), ("v6e", 32, "v6e:4x8"),
    ("v5p", 4, "v5p:2x2x1"), ("v5p", 8, "v5p:2x2x2"), ("v5p", 16, "v5p:2x4x2"),
    ("h100", 1, "1x1x1"), ("h100", 8, "1x1x8"), ("h100", 16, "1x2x8"), ("h200", 2, "1x1x2"),
])
def test_smallest_topology_holding_a_slice(name, n, topology):
    assert get_target(name).topology_name(n) == topology


def test_gpu_slices_fill_whole_hosts():
    with pytest.raises(ConfigError, match="12 GPUs do not fill hosts of 8"):
        get_target("h100").topology_name(12)
