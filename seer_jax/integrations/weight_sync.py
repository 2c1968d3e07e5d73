"""Weight sync: a trainer's parameters -> our parameter dict, resharded onto engine slices.

A trainer (Tunix, or our own) holds the policy as an NNX state or a pytree on its mesh; each
rollout engine holds its own copy on its mesh slice, sharded by `seer_jax.model.sharding`. Sync =
name mapping (`state_to_params`) + resharding (`reshard_params`).

Resharding is built from single-device pieces: for every shard the destination needs, take a
source shard that covers it, slice it on that shard's device (a jitted `lax.slice` with static
bounds, so no host scalars are sent) and, if it sits on another device, move it device to device.
Nothing crosses the host, so this runs under Tunix's transfer guard on CPU, where
`jax.device_put` across device sets would go through host memory. The result never aliases the
source buffers: trainers donate their parameter buffers to the next optimizer step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, Sharding

from seer_jax.errors import ConfigError
from seer_jax.model.config import ModelConfig
from seer_jax.model.llama import Params, flat_params, jnp_dtype, nest_params, param_shapes
from seer_jax.model.sharding import ShardingRules, param_shardings

ParamMapping = Callable[[dict[str, Any]], Params]


def state_to_params(state: Any, cfg: ModelConfig, mapping: ParamMapping | None = None) -> Params:
    """Our nested param dict from an NNX state / pure dict of the trainer's model.

    Default mapping: the trainer's model is `seer_jax.integrations.tunix.TunixLlama` (or our
    `Llama`), whose parameter paths are ours ("embed", "layers/wq", ...). Another model family
    passes `mapping`: a function from its pure dict to our nested dict. Shapes are checked
    against `cfg`; extra entries (LoRA adapters, rng state) are ignored only if a mapping says so.
    """
    from flax import nnx

    if isinstance(state, nnx.State):
        state = nnx.to_pure_dict(state)
    pure = _unwrap(state)
    params = mapping(pure) if mapping is not None else pure
    flat = flat_params(params)
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(flat))
    unknown = sorted(set(flat) - set(expected))
    if missing or unknown:
        raise ConfigError(
            f"trainer state does not match the model config: missing {missing[:6]}, unexpected "
            f"{unknown[:6]}; pass `mapping=` to translate another model's parameter names")
    for k, shape in expected.items():
        if tuple(flat[k].shape) != shape:
            raise ConfigError(f"trainer parameter {k!r} has shape {tuple(flat[k].shape)}, the model "
                              f"config expects {shape}")
    return nest_params({k: flat[k] for k in expected})


def _unwrap(tree: Any) -> Any:
    """Plain dicts of arrays (NNX `Variable`s replaced by their values)."""
    if isinstance(tree, Mapping):
        return {str(k): _unwrap(v) for k, v in tree.items()}
    value = getattr(tree, "value", None)
    if value is not None and not isinstance(tree, jax.Array):
        return value
    return tree


@functools.partial(jax.jit, static_argnames=("starts", "limits", "dtype"))
def _slice_cast(x: jax.Array, starts: tuple[int, ...], limits: tuple[int, ...], dtype) -> jax.Array:
    return jax.lax.slice(x, starts, limits).astype(dtype)


@functools.partial(jax.jit, static_argnames=("offsets",))
def _place(base: jax.Array, piece: jax.Array, offsets: tuple[int, ...]) -> jax.Array:
    return jax.lax.dynamic_update_slice(base, piece, offsets)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    return jnp.zeros(shape, dtype)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.start or 0, shape[i] if s.stop is None else s.stop) for i, s in enumerate(index))


def _block(want, sources, device, dtype) -> jax.Array:
    """The `want` block of the array on `device`, cut from the source shards."""
    covering = [s for s in sources
                if all(a0 <= b0 and b1 <= a1 for (a0, a1), (b0, b1) in zip(s[1], want, strict=True))]
    if covering:  # one source shard holds the whole block: prefer the one already on `device`
        dev, bounds, data = next((s for s in covering if s[0] == device), covering[0])
        piece = _slice_cast(data, tuple(w0 - s0 for (w0, _), (s0, _) in zip(want, bounds, strict=True)),
                            tuple(w1 - s0 for (_, w1), (s0, _) in zip(want, bounds, strict=True)), dtype)
        return piece if dev == device else jax.device_put(piece, device)
    # assemble from the intersections with distinct source blocks
    out = None
    seen = set()
    by_bounds: dict = {}
    for s in sources:
        if s[1] not in by_bounds or s[0] == device:
            by_bounds[s[1]] = s
    for bounds, (dev, _, data) in by_bounds.items():
        inter = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(bounds, want, strict=True))
        if any(lo >= hi for lo, hi in inter) or inter in seen:
            continue
        seen.add(inter)
        piece = _slice_cast(data, tuple(lo - s0 for (lo, _), (s0, _) in zip(inter, bounds, strict=True)),
                            tuple(hi - s0 for (_, hi), (s0, _) in zip(inter, bounds, strict=True)), dtype)
        if dev != device:
            piece = jax.device_put(piece, device)
        if out is None:
            out = jax.device_put(_zeros(tuple(w1 - w0 for w0, w1 in want), dtype), device)
        out = _place(out, piece, tuple(lo - w0 for (lo, _), (w0, _) in zip(inter, want, strict=True)))
    return out


def reshard_array(x: jax.Array, sharding: Sharding, dtype=None) -> jax.Array:
    """A fresh copy of `x` laid out as `sharding` (and cast to `dtype`), device to device only."""
    dtype = jnp.dtype(dtype or x.dtype)
    shape = tuple(x.shape)
    if not isinstance(x, jax.Array) or not x.is_fully_addressable:
        return jax.device_put(jnp.asarray(x, dtype), sharding, may_alias=False)
    sources = [(s.device, _bounds(s.index, shape), s.data) for s in x.addressable_shards]
    pieces = [_block(_bounds(index, shape), sources, device, dtype)
              for device, index in sharding.addressable_devices_indices_map(shape).items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def reshard_params(params: Params, mesh: Mesh, cfg: ModelConfig,
                   rules: ShardingRules = ShardingRules()) -> Params:
    """Copy params onto one engine slice with our sharding rules, cast to the model dtype."""
    shardings = flat_params(param_shardings(params, mesh, rules))
    dtype = jnp_dtype(cfg)
    return nest_params({k: reshard_array(v, shardings[k], dtype)
                        for k, v in flat_params(params).items()})


def params_on(params: Params, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> bool:
    """True if every parameter already has the sharding our rules give on `mesh`."""
    shardings = flat_params(param_shardings(params, mesh, rules))
    for k, v in flat_params(params).items():
        s = getattr(v, "sharding", None)
        if not isinstance(s, NamedSharding) or not s.is_equivalent_to(shardings[k], v.ndim):
            return False
    return True
