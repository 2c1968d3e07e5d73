"""Built-in prompt sets and JSONL prompt loading."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from seer_jax.errors import ConfigError, InputError
from seer_jax.rollout.core.prompts import PROMPT_SETS, load_jsonl, prompt_set, prompt_texts


@pytest.mark.parametrize("name", PROMPT_SETS)
def test_sets_have_enough_distinct_prompts(name):
    items = prompt_set(name)
    assert len(items) >= 48
    texts = prompt_texts(name)
    assert len(set(texts)) == len(texts)
    assert all(t.strip() == t and len(t) > 10 for t in texts)


def test_structured_sizes_are_stated_and_long_tailed():
    items = prompt_set("structured")
    sizes = np.array([p.size_hint for p in items], dtype=float)
    assert (sizes > 0).all()
    for p in items:  # the size is stated in the prompt text
        assert str(p.size_hint) in re.findall(r"\d+", p.text)
    assert {p.category for p in items} >= {"enumeration", "story", "derivation"}
    assert sizes.max() / np.median(sizes) >= 5  # a long tail across prompts
    assert np.mean(sizes) > np.median(sizes)


def test_structured_prefixes_keep_the_long_tail():
    """A run uses the first num_prompts prompts: every prefix of 16 (and 8) must span the
    stated sizes, not just the small ones."""
    items = prompt_set("structured")
    counting = [p.text.startswith(("Write the numbers", "Count down")) for p in items]
    base = [p.size_hint // 3 if c else p.size_hint for c, p in zip(counting, items, strict=True)]
    for start in range(0, len(items), 16):
        block = base[start:start + 16]
        assert sorted(block) == sorted(base[:16])  # every stated size once per block
        assert max(block[:8]) >= 45 and min(block[:8]) <= 3
    for n in (8, 16, 32):
        sizes = np.array([p.size_hint for p in items[:n]], dtype=float)
        assert sizes.max() / np.median(sizes) >= 5
    kinds = ["count" if c else p.category for c, p in zip(counting, items, strict=True)]
    for k in set(kinds):  # every task kind gets every stated size once
        assert sorted(b for b, kk in zip(base, kinds, strict=True) if kk == k) == sorted(base[:16])


def test_natural_set_is_math_and_reasoning():
    cats = {p.category for p in prompt_set("natural")}
    assert cats == {"math", "reasoning"}


def test_unknown_set():
    with pytest.raises(ConfigError, match="'poems'.*natural"):
        prompt_set("poems")


def test_load_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "What is 2+2?"},
        {"question": "Name a prime.", "category": "math", "size_hint": 3},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Hello?"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = load_jsonl(f)
    assert [p.text for p in items] == ["What is 2+2?", "Name a prime.", "Hello?"]
    assert items[1].category == "math" and items[1].size_hint == 3
    assert items[2].messages == (("system", "Be brief."), ("user", "Hello?"))


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"answer": 3}', "needs a 'prompt'"),
        ('{"prompt": ""}', "non-empty string"),
        ('{"messages": [{"role": "system", "content": "x"}]}', "no 'user' turn"),
        ('{"messages": [{"content": "x"}]}', "'role' and 'content'"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path, line, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(InputError, match=msg) as e:
        load_jsonl(f)
    assert "bad.jsonl:2" in str(e.value)


def test_load_jsonl_missing_or_empty(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="no prompts"):
        load_jsonl(empty)
