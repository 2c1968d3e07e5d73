"""Llama-family model: config, NNX parameters, loading, tokenizer, reference generator."""

from __future__ import annotations

import pathlib

from seer_jax.model.config import ModelConfig


def load(name_or_path: str, dtype: str = "float32", tokenizer: str | None = None,
         tokenizer_required: bool = True):
    """(cfg, params, tokenizer) for "smollm2", a .gguf file, a HF directory or an Orbax checkpoint.

    The tokenizer comes from the same place unless `tokenizer` names another source; Orbax
    checkpoints carry none (pass `tokenizer`, or get None). tokenizer_required=False: a HF
    checkpoint without tokenizer files gives None too (a caller that works on token ids).
    """
    from seer_jax.model.hub import resolve_model
    from seer_jax.model.loading import ORBAX_CONFIG, load_model
    from seer_jax.model.tokenizer import Tokenizer

    path = resolve_model(name_or_path)
    cfg, params = load_model(path, dtype)
    tok_src = pathlib.Path(tokenizer) if tokenizer else path
    tok = None
    if tokenizer or not (path.is_dir() and (path / ORBAX_CONFIG).is_file()):
        if tokenizer or tokenizer_required or _has_tokenizer(path):
            tok = Tokenizer.load(tok_src)
    return cfg, params, tok


def _has_tokenizer(path: pathlib.Path) -> bool:
    """Whether a model file or HF directory carries tokenizer files (`Tokenizer.load`'s)."""
    if path.is_dir():
        return (path / "tokenizer.json").is_file() or len(list(path.glob("*.gguf"))) == 1
    if path.suffix == ".safetensors":
        return (path.parent / "tokenizer.json").is_file()
    return True


__all__ = ["ModelConfig", "load"]
