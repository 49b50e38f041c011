"""The built-in demo task: synthetic integer arithmetic that asks for a calculator tool call.

Each row is in verl's layout (see :mod:`.records`)::

    {"prompt": [{"role": "user", "content":
        "What is 317 * 29 + 4? Use the calculator tool, then answer with \\boxed{N}."}],
     "data_source": "asyncrl/arith", "ability": "arithmetic",
     "reward_model": {"style": "rule", "ground_truth": "9197"},
     "extra_info": {"index": 0, "split": "train", "expression": "317 * 29 + 4",
                    "tools_kwargs": {"calculator": {"create_kwargs": {"expression": "317 * 29 + 4"}}}}}

Contracts: generation is a pure function of (``n``, ``seed``, ``split``, ``spec``); the
ground truth is the exact integer value of the expression with the usual precedence
(``*`` before ``+``/``-``, left to right), written as a decimal string; answers may be
negative when ``-`` is enabled. The wording is one fixed template so a very small model can
learn it. Validation expressions never repeat a training expression
(:func:`write_demo_dataset` raises ``ValueError`` when the spec's space is too small).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.files import atomic_write

DATA_SOURCE = "asyncrl/arith"
PROMPT_TEMPLATE = "What is {expression}? Use the calculator tool, then answer with \\boxed{{N}}."
TOOL_NAME = "calculator"
_SPLIT_SALT = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class ArithSpec:
    """Difficulty: operands drawn uniformly from ``[min_operand, max_operand]``, between
    ``min_terms`` and ``max_terms`` operands, operators drawn uniformly from ``ops``."""

    min_operand: int = 2
    max_operand: int = 999
    min_terms: int = 2
    max_terms: int = 3
    ops: tuple[str, ...] = ("+", "-", "*")

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError("need 0 <= min_operand <= max_operand")
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError("need 2 <= min_terms <= max_terms")
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ValueError("ops must be a non-empty subset of '+', '-', '*'")

    @classmethod
    def level(cls, difficulty: int) -> ArithSpec:
        """Presets: 0 = two operands 50-99 with + (every question, call and answer has the
        same token length: the built-in demo, learnable by a ~1M-parameter model); 1 = two
        1-2 digit operands with + and -; 2 = two operands up to 99 with +, -, *; 3 = 2-3
        operands up to 999 (the default spec)."""
        if difficulty == 0:
            return cls(min_operand=50, max_operand=99, min_terms=2, max_terms=2, ops=("+",))
        if difficulty == 1:
            return cls(min_operand=1, max_operand=20, min_terms=2, max_terms=2, ops=("+", "-"))
        if difficulty == 2:
            return cls(min_operand=2, max_operand=99, min_terms=2, max_terms=2)
        if difficulty == 3:
            return cls()
        raise ValueError(f"difficulty must be 0, 1, 2 or 3, got {difficulty}")


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Exact value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter.
    Pure integer arithmetic; nothing is parsed or evaluated as code."""
    if len(operands) != len(ops) + 1:
        raise ValueError("need exactly one more operand than operators")
    total, term, sign = 0, operands[0], 1
    for op, value in zip(ops, operands[1:], strict=True):
        if op == "*":
            term *= value
        elif op in ("+", "-"):
            total += sign * term
            sign, term = (1 if op == "+" else -1), value
        else:
            raise ValueError(f"unknown operator {op!r}")
    return total + sign * term


def make_problem(rng: random.Random, spec: ArithSpec) -> tuple[str, int]:
    """One (expression text, exact answer) drawn with ``rng``."""
    n = rng.randint(spec.min_terms, spec.max_terms)
    operands = [rng.randint(spec.min_operand, spec.max_operand) for _ in range(n)]
    ops = [rng.choice(spec.ops) for _ in range(n - 1)]
    text = str(operands[0]) + "".join(f" {op} {v}" for op, v in zip(ops, operands[1:], strict=True))
    return text, evaluate(operands, ops)


def make_row(index: int, split: str, expression: str, answer: int) -> dict[str, Any]:
    """The verl-layout row of one problem."""
    truth = str(answer)
    return {
        "prompt": [{"role": "user", "content": PROMPT_TEMPLATE.format(expression=expression)}],
        "data_source": DATA_SOURCE,
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {
            "index": index,
            "split": split,
            "expression": expression,
            "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"expression": expression}}},
        },
    }


def generate_rows(
    n: int, *, seed: int = 0, split: str = "train", spec: ArithSpec | None = None,
    exclude: set[str] | frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """``n`` rows for ``split``, deterministic in (n, seed, split, spec). Expressions in
    ``exclude`` are redrawn (at most ``100 * n + 1000`` draws, then ``ValueError``)."""
    if split not in _SPLIT_SALT:
        raise ValueError(f"split must be one of {sorted(_SPLIT_SALT)}")
    spec = spec or ArithSpec()
    rng = random.Random(seed * 4 + _SPLIT_SALT[split])
    rows: list[dict[str, Any]] = []
    draws = 0
    while len(rows) < n:
        draws += 1
        if draws > 100 * n + 1000:
            raise ValueError(f"cannot draw {n} {split} problems outside the excluded set; widen the spec")
        expression, answer = make_problem(rng, spec)
        if expression in exclude:
            continue
        rows.append(make_row(len(rows), split, expression, answer))
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def write_demo_dataset(
    directory: str | Path, n_train: int = 1000, n_val: int = 100, seed: int = 0,
    spec: ArithSpec | None = None,
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``val.jsonl`` under ``directory`` (created if needed,
    files replaced atomically); return their paths. Val expressions avoid train ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train = generate_rows(n_train, seed=seed, split="train", spec=spec)
    seen = {r["extra_info"]["expression"] for r in train}
    val = generate_rows(n_val, seed=seed, split="val", spec=spec, exclude=seen)
    train_path, val_path = directory / "train.jsonl", directory / "val.jsonl"
    _write_jsonl(train_path, train)
    _write_jsonl(val_path, val)
    return train_path, val_path
