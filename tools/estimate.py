"""The ``estimate`` tool: a quick, *rounded* arithmetic estimate.

It evaluates the expression like :mod:`tools.calculator` (same whitelist, never ``eval``)
and rounds the result to the nearest ten. It exists for the built-in demo task, where an
agent must learn to choose the exact tool over the approximate one: an answer copied from
``estimate`` is right only when the exact value happens to be a multiple of ten.
"""

from __future__ import annotations

from typing import Any

from tools.base import Tool, ToolResult
from tools.calculator import (
    MAX_EXPRESSION_CHARS,
    CalculatorError,
    evaluate_expression,
    format_number,
)

ROUND_TO = 10


def estimate_value(expression: str) -> int:
    """The expression's value rounded to the nearest multiple of ``ROUND_TO`` (half away from zero)."""
    value = evaluate_expression(expression)
    sign = -1 if value < 0 else 1
    return sign * int((abs(value) + ROUND_TO / 2) // ROUND_TO) * ROUND_TO


class Estimate(Tool):
    name = "estimate"
    description = "Quickly estimate an arithmetic expression, rounded to the nearest ten. Cheap but not exact."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "The expression, e.g. '37 * 45'.",
                                      "maxLength": MAX_EXPRESSION_CHARS}},
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        expression = arguments.get("expression")
        try:
            value = estimate_value(expression)  # type: ignore[arg-type]
        except CalculatorError as exc:
            return ToolResult.error(f"Error: {exc}", expression=str(expression)[:200])
        return ToolResult.ok(format_number(value), expression=expression)
