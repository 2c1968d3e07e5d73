"""LoRA adapters (qwix, as Tunix applies them) merged into the base weights for the rollout.

`qwix.LoraProvider` adds two `nnx.LoRAParam`s next to every weight `w` its rules match:
`w_lora_a` (the weight's contracted dims, then the rank) and `w_lora_b` (the rank, then the
weight's other dims), and computes `x @ w + (alpha / rank) * (x @ a) @ b`. The rollout engine
serves one dense weight, so a sync merges `w + (alpha / rank) * a @ b` (accumulated in float32,
stored in the trainer's dtype) and drops the adapters.

With LoRA, Tunix syncs only the adapters (`filter_types=(nnx.LoRAParam,)`); the frozen base
weights come from the actor the rollout was built from. `alpha` comes from the qwix rule that
matches the weight's module path (the provider is found on the actor's intercepted `__call__`),
or from `lora_alpha=` when given.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from seer_jax.errors import ConfigError

A_SUFFIX, B_SUFFIX = "_lora_a", "_lora_b"
Path = tuple[str, ...]
ScaleFn = Callable[[Path, int], float]  # (module path, rank) -> alpha / rank


def flatten(tree: Mapping[str, Any], prefix: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = v
    return out


def unflatten(flat: Mapping[Path, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def has_lora(tree: Mapping[str, Any]) -> bool:
    return any(p[-1].endswith(A_SUFFIX) for p in flatten(tree))


def merge_lora(tree: Mapping[str, Any], scale: ScaleFn,
               base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`tree` (over `base` when given) with every adapter pair merged into its weight and dropped.

    A weight without adapters is passed through unchanged (no copy)."""
    flat = flatten(base) if base is not None else {}
    flat.update(flatten(tree))
    out = {p: v for p, v in flat.items() if not p[-1].endswith((A_SUFFIX, B_SUFFIX))}
    for path, a in flat.items():
        if not path[-1].endswith(A_SUFFIX):
            continue
        name = path[-1][:-len(A_SUFFIX)]
        where = "/".join(path[:-1] + (name,))
        b = flat.get(path[:-1] + (name + B_SUFFIX,))
        w = out.get(path[:-1] + (name,))
        if b is None or w is None:
            raise ConfigError(f"LoRA adapter {where}{A_SUFFIX} has no "
                              f"{'base weight' if w is None else B_SUFFIX + ' partner'}")
        rank = a.shape[-1]
        if b.shape[0] != rank or math.prod(a.shape[:-1]) * math.prod(b.shape[1:]) != math.prod(w.shape):
            raise ConfigError(f"LoRA adapter of {where}: a {tuple(a.shape)} @ b {tuple(b.shape)} "
                              f"does not cover the weight {tuple(w.shape)}")
        split = _leading_split(tuple(w.shape), math.prod(a.shape[:-1]))
        if split is None:
            raise ConfigError(f"LoRA adapter of {where}: the weight {tuple(w.shape)} does not start "
                              f"with the adapter's input dims {tuple(a.shape[:-1])}")
        out[path[:-1] + (name,)] = _merged(w, a, b, float(scale(path[:-1], rank)))
    return unflatten(out)


def _leading_split(shape: tuple[int, ...], size: int) -> int | None:
    n = 1
    for i, dim in enumerate(shape):
        if n == size:
            return i
        n *= dim
    return len(shape) if n == size else None


@functools.partial(jax.jit, static_argnames=("scale",))
def _merged(w: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    rank = a.shape[-1]
    delta = jnp.dot(a.reshape(-1, rank), b.reshape(rank, -1), preferred_element_type=jnp.float32)
    return (w.astype(jnp.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)


# ---------------------------------------------------------------------------- alpha


def lora_scale_fn(actor: Any, lora_alpha: float | None = None) -> ScaleFn:
    """alpha / rank for an adapter: `lora_alpha` when given, else the alpha of the first qwix
    LoRA rule whose `module_path` matches (found on the actor's qwix provider)."""
    if lora_alpha is not None:
        if not lora_alpha > 0:
            raise ConfigError(f"lora_alpha={lora_alpha!r}: allowed a number > 0")
        return lambda path, rank: lora_alpha / rank
    rules = qwix_lora_rules(actor)

    def scale(path: Path, rank: int) -> float:
        module_path = "/".join(path)
        if rules is None:
            raise ConfigError(f"the actor has LoRA adapters ({module_path}) but no qwix LoRA "
                              "provider was found on it; pass lora_alpha= to SeerRollout")
        for rule in rules:
            if re.fullmatch(rule.module_path, module_path):
                return float(rule.alpha) / rank
        raise ConfigError(f"no qwix LoRA rule matches the module path {module_path!r}; pass "
                          "lora_alpha= to SeerRollout")

    return scale


def qwix_lora_rules(actor: Any) -> list[Any] | None:
    """The LoRA rules of the qwix provider that wrapped the actor's class, or None."""
    call = type(actor).__dict__.get("__call__")
    provider = _find_provider(call, depth=8, seen=set())
    if provider is None:
        return None
    return [r for r in provider._rules if hasattr(r, "alpha") and hasattr(r, "rank")]


def _find_provider(obj: Any, depth: int, seen: set[int]) -> Any:
    if obj is None or depth < 0 or id(obj) in seen:
        return None
    seen.add(id(obj))
    rules = getattr(obj, "_rules", None)
    if isinstance(rules, (list, tuple)) and any(hasattr(r, "alpha") for r in rules):
        return obj
    children: list[Any] = []
    if isinstance(obj, functools.partial):
        children += [obj.func, *obj.args, *obj.keywords.values()]
    children.append(getattr(obj, "__wrapped__", None))
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            children.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    for child in children:
        found = _find_provider(child, depth - 1, seen)
        if found is not None:
            return found
    return None
