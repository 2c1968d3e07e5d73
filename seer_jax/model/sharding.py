"""Logical-axis sharding rules: map parameter logical axes onto a mesh with a `tp` axis.

Heads and FFN are split over `tp` (Megatron-style column/row parallel), and so are the embedding
and LM head along the vocabulary (a large share of a 7B model's weights, and its largest matmul per
decoded token); MoE experts are split over the same axis (expert parallelism: each device holds
whole experts); anything whose size does not divide the mesh axis stays replicated on that
dimension. Works on any (sub-)mesh.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from seer_jax.errors import ConfigError
from seer_jax.model.llama import LOGICAL_AXES, Params, flat_params, layers_split, nest_params


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """logical axis -> mesh axis name (or None = replicated)."""

    q_heads: str | None = "tp"
    kv_heads: str | None = "tp"
    mlp: str | None = "tp"
    vocab: str | None = "tp"
    embed: str | None = None
    layers: str | None = None
    norm: str | None = None
    head_dim: str | None = None
    # MoE experts split over the devices (expert parallelism, `seer_jax.model.moe`), each
    # expert's MLP whole
    experts: str | None = "tp"
    moe_mlp: str | None = None

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else getattr(self, logical)


def make_mesh(devices: list | None = None, tp: int | None = None) -> Mesh:
    """A 1-D `tp` mesh over the given devices (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    tp = len(devices) if tp is None else tp
    if tp < 1 or len(devices) != tp:
        raise ConfigError(f"tp={tp} does not match the {len(devices)} devices given")
    import numpy as np

    return Mesh(np.array(devices), ("tp",))


def partition_spec(shape: tuple[int, ...], logical: tuple[str | None, ...], mesh: Mesh,
                   rules: ShardingRules) -> PartitionSpec:
    axes = []
    for size, name in zip(shape, logical, strict=True):
        axis = rules.mesh_axis(name)
        if axis is not None and (axis not in mesh.shape or size % mesh.shape[axis]):
            axis = None
        axes.append(axis)
    return PartitionSpec(*axes)


def param_shardings(params: Params, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Params:
    """Shardings with the params' structure (stacked or per-layer weights)."""
    if layers_split(params):
        layers = tuple(
            {k: NamedSharding(mesh, partition_spec(tuple(v.shape), LOGICAL_AXES[f"layers/{k}"][1:],
                                                   mesh, rules))
             for k, v in lp.items()}
            for lp in params["layers"])
        rest = param_shardings({k: v for k, v in params.items() if k != "layers"}, mesh, rules)
        return {**rest, "layers": layers}
    flat = flat_params(params)
    return nest_params({
        k: NamedSharding(mesh, partition_spec(tuple(v.shape), LOGICAL_AXES[k], mesh, rules))
        for k, v in flat.items()
    })


def shard_params(params: Params, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Params:
    """Place params on the mesh according to the rules."""
    return jax.device_put(params, param_shardings(params, mesh, rules))
