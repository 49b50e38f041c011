"""The built-in arithmetic demo task: answers recomputed independently, determinism, layout."""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path

import pytest

from recipes.demo.task import ArithSpec, evaluate, generate_rows, write_demo_dataset
from rollout_service.data import PromptStream, load_records

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_QUESTION = re.compile(r"^What is ([0-9 +*-]+)\? Use the calculator tool, then answer with \\boxed\{N\}\.$")


def independent_value(expression: str) -> int:
    """Evaluate with Python's own parser/precedence (ast walk over + - * on ints only)."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise AssertionError(f"unexpected node {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval").body)


@pytest.mark.parametrize("spec", [ArithSpec(), ArithSpec.level(0), ArithSpec.level(1), ArithSpec.level(2), ArithSpec.level(3),
                                  ArithSpec(min_operand=0, max_operand=5, min_terms=4, max_terms=6)])
def test_answers_are_correct(spec: ArithSpec) -> None:
    rows = generate_rows(300, seed=11, spec=spec)
    for row in rows:
        content = row["prompt"][0]["content"]
        m = _QUESTION.match(content)
        assert m, content
        expression = m.group(1)
        assert expression == row["extra_info"]["expression"]
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(independent_value(expression))}
        numbers = [int(x) for x in re.findall(r"\d+", expression)]
        assert spec.min_terms <= len(numbers) <= spec.max_terms
        assert all(spec.min_operand <= x <= spec.max_operand for x in numbers)
        assert set(re.findall(r"[+*-]", expression)) <= set(spec.ops)


def test_evaluate_precedence_examples() -> None:
    assert evaluate([317, 29, 4], ["*", "+"]) == 9197
    assert evaluate([4, 317, 29], ["+", "*"]) == 9197
    assert evaluate([10, 2, 3, 4], ["-", "*", "-"]) == 0
    assert evaluate([5, 7], ["-"]) == -2
    with pytest.raises(ValueError):
        evaluate([1, 2], [])


def test_generation_is_deterministic_and_seed_dependent() -> None:
    assert generate_rows(50, seed=3) == generate_rows(50, seed=3)
    assert generate_rows(50, seed=3) != generate_rows(50, seed=4)
    assert generate_rows(50, seed=3, split="val") != generate_rows(50, seed=3, split="train")
    assert [r["extra_info"]["index"] for r in generate_rows(5)] == [0, 1, 2, 3, 4]


def test_write_demo_dataset_round_trips_through_the_reader(tmp_path: Path) -> None:
    train, val = write_demo_dataset(tmp_path / "demo", n_train=200, n_val=40, seed=5)
    assert (train.name, val.name) == ("train.jsonl", "val.jsonl")
    errors = []
    train_recs, stats = load_records([train], on_error=errors.append)
    val_recs, _ = load_records([val], on_error=errors.append)
    assert errors == [] and stats.records == 200 and len(val_recs) == 40
    rec = train_recs[0]
    assert rec.data_source == "asyncrl/arith" and rec.extra_info["split"] == "train"
    assert rec.messages[0]["role"] == "user"
    assert "tools_kwargs" in rec.extra_info and rec.ground_truth not in json.dumps(rec.extra_info["tools_kwargs"])
    train_exprs = {r.extra_info["expression"] for r in train_recs}
    assert not train_exprs & {r.extra_info["expression"] for r in val_recs}
    # Rewriting with the same arguments gives byte-identical files.
    before = train.read_bytes()
    write_demo_dataset(tmp_path / "demo", n_train=200, n_val=40, seed=5)
    assert train.read_bytes() == before
    assert len(PromptStream.from_files([train], total_epochs=2)) == 400


def test_too_small_space_for_disjoint_val_is_an_error(tmp_path: Path) -> None:
    tiny = ArithSpec(min_operand=1, max_operand=2, min_terms=2, max_terms=2, ops=("+",))  # 4 expressions
    with pytest.raises(ValueError, match="widen the spec"):
        write_demo_dataset(tmp_path, n_train=50, n_val=5, seed=0, spec=tiny)


@pytest.mark.parametrize("kwargs", [
    dict(min_operand=5, max_operand=4), dict(min_terms=1), dict(min_terms=3, max_terms=2), dict(ops=()), dict(ops=("/",)),
])
def test_bad_specs(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ArithSpec(**kwargs)
    with pytest.raises(ValueError):
        ArithSpec.level(4)
