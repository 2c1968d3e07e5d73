"""Llama-family model: config, NNX parameters, loading, tokenizer, reference generator."""

from __future__ import annotations

import pathlib

from seer_jax.model.config import ModelConfig


def load(name_or_path: str, dtype: str = "float32", tokenizer: str | None = None):
    """(cfg, params, tokenizer) for "smollm2", a .gguf file, a HF directory or an Orbax checkpoint.

    The tokenizer comes from the same place unless `tokenizer` names another source; Orbax
    checkpoints carry none (pass `tokenizer`, or get None).
    """
    from seer_jax.model.hub import resolve_model
    from seer_jax.model.loading import ORBAX_CONFIG, load_model
    from seer_jax.model.tokenizer import Tokenizer

    path = resolve_model(name_or_path)
    cfg, params = load_model(path, dtype)
    tok_src = pathlib.Path(tokenizer) if tokenizer else path
    tok = None
    if tokenizer or not (path.is_dir() and (path / ORBAX_CONFIG).is_file()):
        tok = Tokenizer.load(tok_src)
    return cfg, params, tok


__all__ = ["ModelConfig", "load"]
