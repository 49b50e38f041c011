"""A small verifiers environment for the tests (tests/rollout/test_verifiers_env.py), loaded by
the driver as ``data.source = "verifiers:tests.rollout.verifiers_arith"``.

``load_environment(kind=..., rows=...)`` builds, from the classic verifiers API:

- ``"tools"``: a ``vf.ToolEnv`` with a ``calculator`` tool (multi-turn: call, result, answer)
  and a rubric of ``correct`` (weight 1) and ``brief`` (weight 0.5), plus ToolEnv's own
  monitoring metrics (weight 0);
- ``"single"``: a ``vf.SingleTurnEnv`` with the same rubric;
- ``"bad_rubric"``: the single-turn environment with a rubric function that raises.

Each row asks ``What is A + B?`` with its answer; :func:`question_of` reads the expression
back, which the tests' scripted engine uses to answer.
"""

from __future__ import annotations

import re

import verifiers as vf
from datasets import Dataset

QUESTION = re.compile(r"What is ([0-9+\- ]+)\?")


def question_of(text: str) -> str | None:
    found = QUESTION.findall(text)
    return found[-1].strip() if found else None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of + and - exactly and return the number.

    Args:
        expression: the expression, e.g. "12 + 30"
    """
    total, sign = 0, 1
    for tok in expression.replace("+", " + ").replace("-", " - ").split():
        if tok in "+-":
            sign = 1 if tok == "+" else -1
        else:
            total += sign * int(tok)
    return str(total)


def correct(completion, answer) -> float:
    text = completion[-1].content if completion else ""
    return 1.0 if f"\\boxed{{{answer}}}" in (text or "") else 0.0


def brief(completion) -> float:
    text = completion[-1].content if completion else ""
    return 1.0 if len(text or "") <= 40 else 0.0


def broken(completion) -> float:
    raise RuntimeError("this rubric function is broken on purpose")


def rows(n: int) -> Dataset:
    out = []
    for i in range(n):
        a, b = 10 + 7 * i, 30 + 11 * i
        out.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return Dataset.from_list(out)


def load_environment(kind: str = "tools", rows_n: int = 4) -> vf.Environment:
    data = rows(rows_n)
    if kind == "tools":
        rubric = vf.Rubric(funcs=[correct, brief], weights=[1.0, 0.5])
        return vf.ToolEnv(dataset=data, tools=[calculator], max_turns=3, rubric=rubric,
                          system_prompt="Use the calculator, then answer with \\boxed{N}.")
    if kind == "single":
        return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[correct, brief], weights=[1.0, 0.5]),
                                system_prompt="Answer with \\boxed{N}.")
    if kind == "bad_rubric":
        return vf.SingleTurnEnv(dataset=data, rubric=vf.Rubric(funcs=[correct, broken], weights=[1.0, 1.0]))
    raise ValueError(f"unknown kind {kind!r}")
