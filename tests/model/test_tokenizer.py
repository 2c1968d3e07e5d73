"""Tokenizer: GGUF-built BPE and tokenizer.json dirs encode like transformers; chat templates render."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import processors

from seer_jax.errors import InputError, SeerError
from seer_jax.model import hub
from seer_jax.model.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading and trailing  ",
    "a\n\nb\tc\r\nd",
    "12345 + 678 = 13023",
    " 3.14159",
    "héllo wörld — ñandú",
    "日本語のテキスト",
    "emoji 🤖🚀 ok",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm you'll they've",
    "x" * 40,
    "",
    " ",
    "\n",
    "def f(x):\n    return x**2  # comment",
    "<|endoftext|><file_sep>",
    "ZWJ 👨‍👩‍👧 family",
    "\u00a0nbsp\u2003em",
    "cafe\u0301 vs café",
    "the then there <think>x</think>",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? ünïcödé"},
    ],
]

# SmolLM2-style template: a default system turn, plus a guard that uses raise_exception.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # an independent copy

    return list(bytes_to_unicode().values())


def write_tokenizer_gguf(path, pre="smollm", add_bos=False, template=TEMPLATE):
    """A small byte-level BPE vocabulary with merges and control/user-defined tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġthe n", "Ġthe r", "Ġther e", "Ġ a", "i n", "Ġ w", "o r",
              "Ġw or", "l d", "Ġwor ld", "l l", "e ll", "H ell", "Hell o", "Ġ Ġ", "Ċ Ċ", "Ã ©"]
    tokens = list(specials) + byte_alphabet()
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens.append("<think>")
    tokens.append("</think>")
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials) - 2) + [4, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 8,
                       "feed_forward_length": 16, "attention.head_count": 2,
                       "attention.head_count_kv": 2}.items():
        w.add_key_value(f"llama.{key}", value, gguf.GGUFValueType.UINT32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_transformers(ours: Tokenizer, ref, texts=TEXTS, chats=CHATS):
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        # byte-level BPE is lossless: decoding gives the text back (transformers' own decode
        # strips a leading space in some versions)
        assert ours.decode(ids, skip_special_tokens=False) == text
        if ref.decode(ids) == text:  # where transformers' decode is lossless too, match it
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    for chat in chats:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert text == ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
            want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert ours.encode_chat(chat, add_generation_prompt=gen) == list(want)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf")


def test_gguf_tokenizer_matches_transformers(tiny_gguf):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(tiny_gguf)
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    # merges are really used: "Hello" and " world" are single tokens
    assert [ours.id_to_token(i) for i in ours.encode("Hello world")] == ["Hello", "Ġworld"]
    assert_same_as_transformers(ours, ref)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_other_pre_tokenizers_match_transformers(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert_same_as_transformers(ours, ref, chats=[])
    # the splits themselves agree (a tiny vocabulary hides some differences in the ids)
    for text in TEXTS + ["I'M 1234567 abc\r\n\n  x", "don't  STOP!!\n\n\t"]:
        want = ref.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert ours.backend.pre_tokenizer.pre_tokenize_str(text) == want, text


def test_special_ids_and_bos(tmp_path, tiny_gguf):
    tok = Tokenizer.from_gguf(tiny_gguf)
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, 2)
    assert tok.special_ids == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<file_sep>": 3}
    ids = tok.encode("<|im_start|>the<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # specials stay whole
    assert tok.encode("the")[0] != tok.bos_id  # add_bos_token false: no BOS
    assert tok.encode("the", add_bos=True)[0] == tok.bos_id
    assert tok.decode(ids) == "the" and tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the<|im_end|>"
    think = tok.encode("<think>")
    assert len(think) == 1 and tok.decode(think) == "<think>"  # user-defined: whole, not skipped
    with_bos = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "bos.gguf", add_bos=True))
    assert with_bos.encode("the") == [1, *tok.encode("the")]
    assert with_bos.encode_chat(CHATS[0]) == tok.encode_chat(CHATS[0])  # template text, no extra BOS


def test_chat_template_default_system_turn_and_errors(tmp_path, tiny_gguf):
    tok = Tokenizer.from_gguf(tiny_gguf)
    text = tok.apply_chat_template(CHATS[0])
    assert text == (
        "<|im_start|>system\nYou are a tiny test model<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(CHATS[0], add_generation_prompt=False).endswith("assistant\n")
    with pytest.raises(InputError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(InputError):
        tok.apply_chat_template("hello")
    bare = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "bare.gguf", template=None))
    with pytest.raises(SeerError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])


def test_from_dir_matches_transformers(tmp_path, tiny_gguf):
    transformers = pytest.importorskip("transformers")
    src = Tokenizer.from_gguf(tiny_gguf)
    d = tmp_path / "ckpt"
    d.mkdir()
    src.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }))
    ours = Tokenizer.from_dir(d)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)
    assert Tokenizer.load(d).encode("the world") == ours.encode("the world") == src.encode("the world")
    assert Tokenizer.load(tiny_gguf).encode("the world") == src.encode("the world")
    assert Tokenizer.load(tiny_gguf.parent).encode("the world") == src.encode("the world")  # dir, one .gguf
    (d / "model.safetensors").write_bytes(b"")
    assert Tokenizer.load(d / "model.safetensors").eos_id == 2  # a weights file: its directory
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    assert_same_as_transformers(ours, ref)
    # chat_template.jinja (newer checkpoints) wins over tokenizer_config.json
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[0]) == "[What is the capital of France?]"


def test_from_file_detects_bos_post_processor(tmp_path, tiny_gguf):
    src = Tokenizer.from_gguf(tiny_gguf)
    backend = src.backend
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    path = tmp_path / "tokenizer.json"
    backend.save(str(path))
    llama3_like = Tokenizer.from_file(path, bos_token="<|im_start|>")
    assert llama3_like.add_bos_token and llama3_like.encode("the") == [1, *src.encode("the")]
    assert not Tokenizer.from_file(path).add_bos_token  # no BOS named: nothing to add
    assert Tokenizer.from_file(path, bos_token="<|im_start|>", add_bos_token=False).encode("the") == src.encode("the")


def test_bad_sources(tmp_path):
    with pytest.raises(SeerError, match="not found"):
        Tokenizer.load(tmp_path / "nope")
    with pytest.raises(SeerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(SeerError, match="cannot read tokenizer file"):
        Tokenizer.from_file(bad)
    src = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "m.gguf"))
    with pytest.raises(SeerError, match="not in the vocabulary"):
        Tokenizer(src.backend, eos_token="</s>")
    notgguf = tmp_path / "model.bin"
    notgguf.write_bytes(b"PK\x03\x04 pickle zip")
    with pytest.raises(SeerError, match="not a GGUF"):
        Tokenizer.load(notgguf)


# ---- the real SmolLM2 tokenizer -------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers():
    transformers = pytest.importorskip("transformers")
    path = hub.fetch_smollm2()
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert (ours.special_ids["<|endoftext|>"], ours.special_ids["<|im_start|>"]) == (0, 1)
    assert (ours.eos_id, ours.pad_id, ours.bos_id) == (2, 2, 1)
    assert ours.vocab_size == 49152 == len(ref)
    assert ours.encode("Hello")[0] != ours.bos_id  # add_bos_token is false
    assert_same_as_transformers(ours, ref)
    text = ours.apply_chat_template(CHATS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
