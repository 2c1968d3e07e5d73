"""Built-in prompt sets for rollouts and benchmarks, and JSONL prompt loading.

- `natural`: math word problems and short reasoning questions (the usual RL-for-reasoning mix).
  With a small model at temperature 1.0 the output length depends little on the prompt
  (measured on SmolLM2-135M: length ICC ~0.12 on log lengths), so context-aware scheduling has
  little to learn from siblings.
- `structured`: tasks whose inherent output length is stated by the prompt and differs strongly
  between prompts, long-tailed across the set (most prompts ask for a little, a few for a lot):
  enumerations of a stated size, multi-step derivations with a stated number of steps, stories of
  a stated length. Sibling responses then have correlated lengths, like an RL dataset mixing easy
  and hard problems.

Each prompt is a `PromptItem` (text, category, size hint: the stated size, 0 when none).
`load_jsonl(path)` reads one JSON object per line with a "prompt" (or "text" / "question") string,
or a "messages" list of {"role", "content"} (returned as the last user message's content, the rest
in `messages`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from seer_jax.errors import ConfigError, InputError


@dataclasses.dataclass(frozen=True)
class PromptItem:
    text: str
    category: str
    size_hint: int = 0
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) when loaded from a chat JSONL


_NATURAL_QUESTIONS = [
    "A farmer has 17 sheep. All but 9 run away. How many sheep are left?",
    "Tom has 3 times as many apples as Sara. Together they have 48 apples. How many apples does Tom have?",
    "A train travels 180 km in 2.5 hours. What is its average speed in km per hour?",
    "What is the sum of all integers from 1 to 100?",
    "If a shirt costs $40 and is discounted by 25%, what is the sale price?",
    "A rectangle has a perimeter of 36 cm and its length is twice its width. What is its area?",
    "Is 221 a prime number? Explain.",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much does the ball cost?",
    "What is 15% of 240?",
    "Three friends share a pizza cut into 12 slices equally. Each eats 3 slices. How many slices are left?",
    "If 5 machines make 5 widgets in 5 minutes, how long do 100 machines take to make 100 widgets?",
    "Solve for x: 3x + 7 = 25.",
    "A car uses 6 liters of fuel per 100 km. How much fuel does it need for 350 km?",
    "What is the next number in the sequence 2, 6, 12, 20, 30, ...?",
    "Anna is 4 years older than Ben. In 6 years the sum of their ages will be 40. How old is Ben now?",
    "How many minutes are there in a week?",
    "A tank fills in 6 hours with pipe A and in 3 hours with pipe B. How long with both pipes?",
    "What is the greatest common divisor of 84 and 126?",
    "A recipe needs 3 eggs for 12 cookies. How many eggs are needed for 30 cookies?",
    "If today is Wednesday, what day of the week will it be in 100 days?",
    "A store sells pens at 3 for $2. How much do 18 pens cost?",
    "All roses are flowers. Some flowers fade quickly. Can we conclude that some roses fade quickly?",
    "What is the probability of rolling a sum of 7 with two fair dice?",
    "A number doubled and then increased by 9 gives 41. What is the number?",
    "Which is larger: 2 to the power 10, or 10 to the power 3?",
    "A clock shows 3:15. What is the angle between the hour and minute hands?",
    "Mary reads 12 pages a day. How many days does she need for a 300-page book?",
    "What is the least common multiple of 12 and 18?",
    "A cyclist rides 15 km/h for 2 hours and 10 km/h for 1 hour. What is the average speed?",
    "If all Bloops are Razzies and all Razzies are Lazzies, are all Bloops definitely Lazzies?",
    "How many diagonals does a hexagon have?",
    "A price rises by 10% and then falls by 10%. Is the final price higher or lower than the start?",
]


def _natural() -> list[PromptItem]:
    items = [PromptItem(q, "reasoning") for q in _NATURAL_QUESTIONS]
    # templated arithmetic word problems with varied numbers
    names = ["Liam", "Olivia", "Noah", "Emma", "Ava", "Lucas", "Mia", "Ethan"]
    objects = ["marbles", "stickers", "books", "coins", "pencils", "cards", "shells", "stamps"]
    for i in range(16):
        a, b, c = 12 + 7 * i, 3 + (i % 5), 2 + (i % 4)
        n, o = names[i % len(names)], objects[(3 * i) % len(objects)]
        items.append(
            PromptItem(
                f"{n} has {a} {o}. {n} gives {b} {o} to each of {c} friends and then buys "
                f"{a // 3} more. How many {o} does {n} have now? Show your reasoning.",
                "math",
            )
        )
    return items


# stated sizes, long-tailed: most prompts ask for little, a few for a lot
_SIZES = [2, 3, 3, 4, 5, 5, 6, 8, 10, 12, 16, 20, 30, 45, 70, 100]

_TOPICS = [
    "a lighthouse keeper",
    "a lost robot",
    "a dragon who cannot fly",
    "two rival bakers",
    "a girl who collects maps",
    "a city under the sea",
    "an old clockmaker",
    "a cat who becomes mayor",
]

_LISTS = ["animals", "countries", "fruits", "famous scientists", "musical instruments",
          "English verbs", "colors", "sports"]


def _bit_reversed(n: int) -> list[int]:
    """0..n-1 (n a power of two) in bit-reversed order: every prefix of length 2^k is spread
    evenly over the range (0, 8, 4, 12, 2, ... for 16)."""
    bits = n.bit_length() - 1
    return [int(format(i, f"0{bits}b")[::-1], 2) for i in range(n)]


def _structured_item(kind: int, i: int, n: int) -> PromptItem:
    if kind == 0:
        count = (
            f"Write the numbers from 1 to {n * 3} in words, one per line, and nothing else."
            if i % 2 == 0
            else f"Count down from {n * 3} to 1, writing each number in words on its own line."
        )
        return PromptItem(count, "enumeration", n * 3)
    if kind == 1:
        return PromptItem(
            f"List exactly {n} different {_LISTS[i % len(_LISTS)]}, numbered 1 to {n}, each "
            "with a one-sentence description.",
            "enumeration",
            n,
        )
    if kind == 2:
        return PromptItem(
            f"Write a story about {_TOPICS[i % len(_TOPICS)]} that is exactly {n} sentences long.",
            "story",
            n,
        )
    return PromptItem(
        f"Starting from {7 + i}, apply the rule 'multiply by 3, then subtract 4' {n} times. "
        "Show every step on its own line with the full calculation.",
        "derivation",
        n,
    )


def _structured() -> list[PromptItem]:
    """Every (size, task kind) pair once, ordered so that any prefix (a run's first
    num_prompts) keeps the long tail: each block of 16 prompts has every stated size once, in
    bit-reversed order (a prefix of 8 spans the range too), and the task kind rotates between
    blocks, so 4 blocks hold every pair exactly once."""
    order = _bit_reversed(len(_SIZES))
    items: list[PromptItem] = []
    for block in range(4):
        for k, i in enumerate(order):
            items.append(_structured_item((k + block) % 4, i, _SIZES[i]))
    return items


def prompt_set(name: str) -> list[PromptItem]:
    """A built-in prompt set by name: 'natural' or 'structured' (>= 48 prompts each)."""
    if name == "natural":
        return _natural()
    if name == "structured":
        return _structured()
    raise ConfigError(f"prompt set {name!r} is unknown; allowed: {list(PROMPT_SETS)}")


PROMPT_SETS = ("natural", "structured")


def prompt_texts(name: str) -> list[str]:
    return [p.text for p in prompt_set(name)]


def load_jsonl(path: str | pathlib.Path) -> list[PromptItem]:
    """Prompts from a JSONL file (see the module docstring for the accepted keys)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise InputError(f"prompt file not found: {path}")
    items = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{path}:{lineno}: expected a JSON object")
            cat = str(obj.get("category", "jsonl"))
            size = int(obj.get("size_hint", 0) or 0)
            text = next((obj[k] for k in ("prompt", "text", "question") if k in obj), None)
            if text is not None:
                if not isinstance(text, str) or not text:
                    raise InputError(f"{path}:{lineno}: prompt must be a non-empty string")
                items.append(PromptItem(text, cat, size))
                continue
            msgs = obj.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise InputError(
                    f"{path}:{lineno}: needs a 'prompt' (or 'text'/'question') string or a "
                    "'messages' list"
                )
            try:
                pairs = tuple((str(m["role"]), str(m["content"])) for m in msgs)
            except (KeyError, TypeError):
                raise InputError(
                    f"{path}:{lineno}: each message needs 'role' and 'content'"
                ) from None
            users = [c for r, c in pairs if r == "user"]
            if not users:
                raise InputError(f"{path}:{lineno}: messages have no 'user' turn")
            items.append(PromptItem(users[-1], cat, size, messages=pairs))
    if not items:
        raise InputError(f"prompt file {path} has no prompts")
    return items
