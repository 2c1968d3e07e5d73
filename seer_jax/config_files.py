"""Load ml_collections config files (`get_config()`), with `--config.key=value` overrides."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import ml_collections

from seer_jax.errors import ConfigError


def load_config_file(path: str | pathlib.Path, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    """Execute a config file and call its `get_config()`, then apply `--config.a.b=value` overrides.

    Override values are parsed as Python literals and must keep the type of the existing value
    (ints are accepted where floats are expected); unknown keys are an error.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"_seer_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a user's file: report it, not a deep traceback
        raise ConfigError(f"config file {path} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} has no get_config() function")
    cfg = module.get_config()
    apply_overrides(cfg, overrides)
    return cfg


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: list[str]) -> None:
    for item in overrides:
        if not item.startswith("--config.") or "=" not in item:
            raise ConfigError(f"override {item!r} must look like --config.key=value")
        key, raw = item[len("--config.") :].split("=", 1)
        parts = key.split(".")
        node = cfg
        for p in parts[:-1]:
            if p not in node:
                raise ConfigError(f"unknown config key {key!r} (no {p!r})")
            node = node[p]
        leaf = parts[-1]
        if leaf not in node:
            raise ConfigError(f"unknown config key {key!r}; known: {sorted(node.keys())}")
        old = node[leaf]
        node[leaf] = _coerce(key, raw, old)


def _coerce(key: str, raw: str, old):
    if isinstance(old, str) or old is None:
        try:
            v = ast.literal_eval(raw)
            return v if old is None else (v if isinstance(v, str) else raw)
        except (ValueError, SyntaxError):
            return raw
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise ConfigError(f"config.{key}={raw!r}: not a valid {type(old).__name__}") from None
    if isinstance(old, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"config.{key}={raw!r}: expected True or False")
        return value
    if isinstance(old, float) and isinstance(value, int):
        return float(value)
    if isinstance(old, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(old)(value)
    if not isinstance(value, type(old)):
        raise ConfigError(f"config.{key}={raw!r}: expected {type(old).__name__}")
    return value
