"""The ``estimate`` tool: a quick, *rounded* arithmetic estimate.

It evaluates the expression like :mod:`tools.calculator` (same whitelist, never ``eval``)
and rounds the result to the nearest ten. It exists for the built-in demo task, where an
agent must learn to choose the exact tool over the approximate one: an answer copied from
``estimate`` is right only when the exact value happens to be a multiple of ten.
"""

from __future__ import annotations

from tools.calculator import MAX_EXPRESSION_CHARS, Calculator, evaluate_expression

ROUND_TO = 10


def estimate_value(expression: str) -> int:
    """The expression's value rounded to the nearest multiple of ``ROUND_TO`` (half away from zero)."""
    value = evaluate_expression(expression)
    sign = -1 if value < 0 else 1
    return sign * int((abs(value) + ROUND_TO / 2) // ROUND_TO) * ROUND_TO


class Estimate(Calculator):
    """Same parsing, limits and error messages as the calculator; only the value differs."""

    name = "estimate"
    description = "Quickly estimate an arithmetic expression, rounded to the nearest ten. Cheap but not exact."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression, e.g. '37 * 45'.",
                                      "maxLength": MAX_EXPRESSION_CHARS}},
        "required": ["expression"],
        "additionalProperties": False,
    }
    evaluate = staticmethod(estimate_value)
