"""Build the tokenizer of ``builtin:tiny`` and write it to ``assets/tiny_tokenizer.json``.

Run: ``python -m asyncrl.models.build_tiny_tokenizer`` (the shipped JSON is the output of
this script; the builtin model loads the JSON, so it never depends on BPE training being
bit-for-bit reproducible across `tokenizers` releases).

The tokenizer is a byte-level BPE (every UTF-8 string round-trips), digits are split one
per token (arithmetic stays learnable for a tiny model), and the ChatML / Hermes tool-call
markers are single special tokens. Its corpus is generated here, deterministically: short
English, arithmetic, JSON tool calls and Python snippets, which is what the demo tasks and
the tests talk about. Not covered: efficient tokenisation of other languages (they fall
back to bytes, which is correct but long).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
]
VOCAB_SIZE = 2048
ASSET = Path(__file__).parent / "assets" / "tiny_tokenizer.json"

_SENTENCES = [
    "You are a helpful assistant.",
    "What is the answer to the question?",
    "Use the calculator tool to compute the result, then give the final answer.",
    "The final answer is",
    "Let me compute this step by step.",
    "I will call the tool to check my work.",
    "Please solve the following problem and put the answer in a box.",
    "The quick brown fox jumps over the lazy dog.",
    "A train travels at a constant speed for several hours.",
    "How many apples are left after some are eaten?",
    "The sum of two numbers is given; find the product.",
    "Write a Python function that returns the square of a number.",
    "The tool returned an error message.",
    "Thank you. The result has been verified.",
    "To call a tool, write a JSON object with its name and arguments between tags:",
    "You can use these tools. Their signatures, as JSON schemas:",
]
_TOOLS = ["calculator", "python", "search", "lookup", "weather"]
_PY = [
    "def square(x):\n    return x * x\n",
    "print(sum(range(10)))\n",
    "import math\nprint(math.sqrt(16))\n",
    "for i in range(3):\n    print(i)\n",
    "result = [n for n in range(20) if n % 2 == 0]\nprint(result)\n",
]


def _template_lines() -> list[str]:
    roles = ["system", "user", "assistant", "tool"]
    return [f"<|im_start|>{r}\n" for r in roles] * 50 + [
        "<|im_end|>\n<|im_start|>assistant\n",
        "<tools>\n", "</tools>\n", '{"name": "tool_name", "arguments": {"arg": "value"}}',
    ] * 50


def _stdlib_prose() -> list[str]:
    """English prose from docstrings of a few stdlib modules (shipped output is frozen)."""
    import argparse
    import collections
    import json as json_mod
    import string
    import textwrap

    docs = [m.__doc__ or "" for m in (argparse, collections, json_mod, string, textwrap)]
    return [line for doc in docs for line in doc.splitlines() if line.strip()]


def build_corpus(seed: int = 0, size: int = 4000) -> list[str]:
    """A deterministic list of training strings for the BPE trainer."""
    rng = random.Random(seed)
    lines = list(_SENTENCES) + list(_PY) + _template_lines() + _stdlib_prose()
    for _ in range(size):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*", "/"])
        tool = rng.choice(_TOOLS)
        lines.append(f"What is {a} {op} {b}?")
        lines.append(f"{a} {op} {b} = ")
        lines.append("<tool_call>\n" + json.dumps({"name": tool, "arguments": {"expression": f"{a} {op} {b}"}}) + "\n</tool_call>")
        lines.append(f"<tool_response>\n{rng.randint(-9999, 99999)}\n</tool_response>")
        lines.append(f"The final answer is \\boxed{{{rng.randint(0, 9999)}}}.")
        lines.append(rng.choice(_SENTENCES) + " " + rng.choice(_SENTENCES))
        lines.append(json.dumps({"type": "function", "function": {"name": tool, "description": rng.choice(_SENTENCES),
                                 "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}))
    return lines


def build_tokenizer(seed: int = 0) -> Tokenizer:
    """Train the byte-level BPE on :func:`build_corpus` and return it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    return tok


def main() -> None:
    ASSET.parent.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(ASSET))
    print(f"wrote {ASSET}")


if __name__ == "__main__":
    main()
