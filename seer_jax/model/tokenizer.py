"""Tokenizer: a `tokenizers.Tokenizer` plus special token ids and the model's chat template.

Three sources:
- `Tokenizer.from_dir(d)`: a HF checkpoint directory (`tokenizer.json`, `tokenizer_config.json`,
  optionally `chat_template.jinja`);
- `Tokenizer.from_file(p)`: a lone `tokenizer.json` (special tokens passed by the caller);
- `Tokenizer.from_gguf(p)`: a byte-level BPE rebuilt from a GGUF's vocab and merges, with the
  pre-tokenizer llama.cpp names in `tokenizer.ggml.pre` (SmolLM2: digits split one by one, then
  GPT-2's byte-level split). It encodes exactly like transformers' tokenizer for the same file.
`Tokenizer.load(p)` picks one of these from what `p` is.

Chat templates are rendered with jinja2 in a sandbox, set up the way transformers does it
(`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `tojson`, `raise_exception`, `strftime_now`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from seer_jax.errors import InputError, SeerError

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Split regexes for byte-level BPE vocabularies, by llama.cpp's `tokenizer.ggml.pre` name. Names not
# listed use GPT-2's split (built into `pre_tokenizers.ByteLevel`).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Vocabularies whose digits are split one by one before GPT-2's split.
DIGIT_SPLIT_PRE = {"smollm"}


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = getattr(self, name)
            if token is not None and backend.token_to_id(token) is None:
                raise SeerError(f"tokenizer: {name} {token!r} is not in the vocabulary")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """From a GGUF file, a HF checkpoint directory (or a file in one) or a `tokenizer.json`.

        A directory without `tokenizer.json` but with exactly one `.gguf` uses that GGUF.
        """
        path = pathlib.Path(path)
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if not (path / "tokenizer.json").is_file() and len(ggufs) == 1:
                return cls.from_gguf(ggufs[0])
            return cls.from_dir(path)
        if not path.exists():
            raise SeerError(f"tokenizer source not found: {path}")
        if path.suffix == ".json":
            return cls.from_file(path)
        if path.suffix == ".safetensors":
            return cls.from_dir(path.parent)
        return cls.from_gguf(path)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> Tokenizer:
        """A `tokenizer.json`; special tokens and chat template as keyword arguments."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise SeerError(f"tokenizer file not found: {path}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust error names the problem; keep it, drop the traceback
            raise SeerError(f"cannot read tokenizer file {path}: {e}") from e
        kwargs.setdefault("add_bos_token", _post_processor_adds_bos(backend, kwargs.get("bos_token")))
        return cls(backend, **kwargs)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """A HF checkpoint directory: `tokenizer.json` + `tokenizer_config.json` (+ chat template)."""
        path = pathlib.Path(path)
        if not path.is_dir():
            raise SeerError(f"model directory not found: {path}")
        tok_json = path / "tokenizer.json"
        if not tok_json.is_file():
            raise SeerError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        config = {}
        cfg_path = path / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise SeerError(f"{cfg_path} is not valid JSON: {e}") from e
        template = _template_from_config(config.get("chat_template"))
        jinja_path = path / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text()
        kwargs = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        if "add_bos_token" in config:
            kwargs["add_bos_token"] = bool(config["add_bos_token"])
        return cls.from_file(tok_json, chat_template=template, **kwargs)

    @classmethod
    def from_gguf(cls, path_or_reader) -> Tokenizer:
        """The byte-level BPE tokenizer (`tokenizer.ggml.model == "gpt2"`) stored in a GGUF."""
        from seer_jax.model.gguf import read_gguf_tokenizer

        data = read_gguf_tokenizer(path_or_reader)
        if data.model != "gpt2":
            raise SeerError(
                f"GGUF tokenizer model {data.model!r} is not supported (only byte-level BPE, 'gpt2'); "
                "use the model's tokenizer.json instead"
            )
        backend = _byte_level_bpe(data.tokens, data.merges, data.token_types, data.pre)

        def token(i):
            return data.tokens[i] if i is not None and 0 <= i < len(data.tokens) else None

        return cls(
            backend,
            chat_template=data.chat_template,
            bos_token=token(data.bos_id),
            eos_token=token(data.eos_id),
            pad_token=token(data.pad_id),
            unk_token=token(data.unk_id),
            add_bos_token=data.add_bos_token,
        )

    # ---- ids ----------------------------------------------------------------------------------

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        """The pad token's id, or the EOS id when the model names no pad token."""
        pad = self._id(self.pad_token)
        return self.eos_id if pad is None else pad

    @property
    def unk_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[str, int]:
        """Every special (control) token, by its text."""
        return {
            t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special
        }

    # ---- text ---------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS first only when the model adds one (or `add_bos=True`)."""
        if not isinstance(text, str):
            raise InputError(f"encode() takes a string, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids, add_bos)

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
        encs = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids, add_bos) for e in encs]

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        add = self.add_bos_token if add_bos is None else add_bos
        if add and self.bos_id is not None:
            return [self.bos_id, *ids]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        """The prompt text for `messages` (`[{"role": ..., "content": ...}, ...]`).

        Extra keyword arguments are visible to the template (e.g. `tools`, `enable_thinking`).
        """
        if self.chat_template is None:
            raise SeerError("this model has no chat template; pass a plain prompt instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InputError("chat messages must be a list of {'role': ..., 'content': ...} dicts")
        import jinja2

        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return _compile_template(self.chat_template).render(**context)
        except jinja2.TemplateError as e:
            raise InputError(f"chat template rejected the messages: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes any BOS itself)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_bos=False)


# ---- helpers ----------------------------------------------------------------------------------


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> tokenizers.Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:  # a few files store tokens as raw text; respell those
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(spelled(token), i)
    pairs = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise SeerError(f"GGUF merge {merge!r} is not two tokens separated by a space")
        pairs.append((parts[0], parts[1]))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (<|im_start|>...) stay whole and are skippable when decoding; user-defined
    # ones (<think>) stay whole but are ordinary text. A "control" token spelled outside the byte
    # alphabet is a llama.cpp mislabel (transformers skips those too).
    types = (list(token_types) + [1] * len(tokens))[: len(tokens)]
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == TOKEN_CONTROL and set(t) <= alphabet
    ]
    if special:
        backend.add_special_tokens(special)
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == TOKEN_USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens(user)
    return backend


def _post_processor_adds_bos(backend: tokenizers.Tokenizer, bos_token: str | None) -> bool:
    if bos_token is None:
        return False
    bos = backend.token_to_id(bos_token)
    return bos is not None and bos in backend.encode("a", add_special_tokens=True).ids


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _template_from_config(value) -> str | None:
    """`chat_template` is a string, or a list of `{"name", "template"}` (we use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    raise SeerError(f"unexpected chat_template of type {type(value).__name__} in tokenizer_config.json")


@functools.lru_cache(maxsize=16)
def _compile_template(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text; we just render it."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise SeerError(f"the model's chat template is not valid jinja: {e}") from e
