"""Calculator tool: arithmetic on a whitelisted Python-expression syntax, without eval.

``evaluate_expression(text)`` parses ``text`` with ``ast.parse(mode="eval")`` and walks the
tree itself, accepting only:

- numbers (int, float; not bool, complex or strings), the names ``pi``, ``e``, ``tau``;
- binary ``+ - * / // % **``, unary ``-`` and ``+``, parentheses;
- calls of whitelisted functions by plain name with positional arguments:
  ``sqrt abs round min max floor ceil log log2 log10 exp sin cos tan asin acos atan``.

Everything else (attribute access, other names, subscripts, lambdas, comprehensions,
strings, keywords, ``__import__``) is refused with a :class:`CalculatorError` whose message
is shown to the model. Nothing is ever passed to ``eval``/``exec``/``compile``-and-run.

Bounds, so that no expression can hang the event loop or exhaust memory (all checks happen
*before* the expensive operation): expression length ``MAX_EXPRESSION_CHARS``, AST size
``MAX_AST_NODES``, integers of at most ``MAX_INT_BITS`` bits (``9**9**9`` and
``10**10**10`` are refused at once, from the exponent), ``round``'s digits bounded,
float overflow and non-finite results refused, division/modulo by zero refused.

Output: integers in full (no ``.0``), floats with 12 significant digits (``0.1+0.2`` →
``0.3``); a float with an integral value below 1e15 prints as an integer (``4/2`` → ``2``).

Not covered: exact rational or decimal arithmetic (floats are IEEE doubles), complex
numbers, variables or multi-statement programs (use the python tool), units.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

from tools.base import Tool, ToolResult

MAX_EXPRESSION_CHARS = 1_000  # longer than any arithmetic a model writes by hand
MAX_AST_NODES = 500  # bounds evaluation work: each node does at most one bounded operation
MAX_INT_BITS = 4_096  # ~1,233 decimal digits; big-int multiply at this size takes microseconds
MAX_ROUND_DIGITS = 100  # round(5, -10**9) would build 10**(10**9) internally
SIGNIFICANT_DIGITS = 12  # hides binary noise (0.1+0.2) while keeping useful precision
MAX_INTEGRAL_FLOAT = 1e15  # integral floats below this print as ints; beyond, digits lie

_BINARY_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPERATORS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
}
_OPERATOR_HINTS = {ast.BitXor: "use ** for powers", ast.MatMult: "use * to multiply"}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is for the model."""


def _check_int(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number (overflow)")
    return value


def _power(base: Any, exponent: Any) -> Any:
    """``base ** exponent``, refusing integer results that would exceed MAX_INT_BITS."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # |base|**exp has more than (bit_length(base) - 1) * exp bits.
        if (base.bit_length() - 1) * exponent > MAX_INT_BITS:
            raise CalculatorError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(base, int) and isinstance(exponent, int) and exponent < 0 and base == 0:
        raise CalculatorError("division by zero")
    result = base**exponent
    if isinstance(result, complex):
        raise CalculatorError("complex result (negative number to a fractional power)")
    return result


class _Evaluator:
    """Walks a parsed expression; one method per accepted node type."""

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return self.visit(node.body)
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise CalculatorError(f"unsupported literal {value!r}: only numbers are allowed")
            return _check_int(value)
        if isinstance(node, ast.Name):
            if node.id in _CONSTANTS:
                return _CONSTANTS[node.id]
            raise CalculatorError(f"unknown name '{node.id}'")
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
            return _UNARY_OPERATORS[type(node.op)](self.visit(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
            left, right = self.visit(node.left), self.visit(node.right)
            if isinstance(node.op, ast.Pow):
                return _check_int(_power(left, right))
            return _check_int(_BINARY_OPERATORS[type(node.op)](left, right))
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.BinOp):
            hint = _OPERATOR_HINTS.get(type(node.op))
            raise CalculatorError(
                f"operator {type(node.op).__name__} is not supported"
                + (f" ({hint})" if hint else "")
            )
        raise CalculatorError(f"{type(node).__name__} is not allowed in an arithmetic expression")

    def _call(self, node: ast.Call) -> Any:
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            what = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise CalculatorError(
                f"function '{what}' is not available; use one of: {', '.join(_FUNCTIONS)}"
            )
        if node.keywords:
            raise CalculatorError("keyword arguments are not supported")
        args = [self.visit(arg) for arg in node.args]  # ast.Starred is refused by visit()
        name = node.func.id
        if name == "round" and len(args) == 2:
            if not isinstance(args[1], int) or abs(args[1]) > MAX_ROUND_DIGITS:
                raise CalculatorError(
                    f"round() digits must be an integer within ±{MAX_ROUND_DIGITS}"
                )
        return _check_int(_FUNCTIONS[name](*args))


def format_number(value: int | float) -> str:
    """Integers in full; floats to SIGNIFICANT_DIGITS, integral ones without ``.0``."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < MAX_INTEGRAL_FLOAT:
        return str(int(value))
    return format(value, f".{SIGNIFICANT_DIGITS}g")


def evaluate_expression(expression: str) -> int | float:
    """The value of ``expression``; raises CalculatorError (with a model-facing message)."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long (limit {MAX_EXPRESSION_CHARS} characters)")
    if not expression.strip():
        raise CalculatorError("empty expression")
    try:
        with warnings.catch_warnings():  # "invalid decimal literal" etc. on odd model text
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        detail = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        raise CalculatorError(f"not a valid expression ({detail})") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_AST_NODES:
        raise CalculatorError(f"expression too complex (limit {MAX_AST_NODES} syntax nodes)")
    try:
        value = _Evaluator().visit(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result is not a finite number (overflow)") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    except (ValueError, TypeError) as exc:
        if isinstance(exc, CalculatorError):
            raise
        raise CalculatorError(f"cannot evaluate: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError("the expression did not produce a number")
    return value


class Calculator(Tool):
    """The ``calculator`` tool: evaluates one arithmetic expression (see the module docstring)."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression exactly as written and return the number. "
        "Supports + - * / // % ** and parentheses, the constants pi, e, tau, and the "
        f"functions {', '.join(_FUNCTIONS)}. No variables."
    )
    evaluate = staticmethod(evaluate_expression)
    """The expression's value; subclasses (``tools.estimate``) change only this."""
    parameters = {
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "description": "The expression, e.g. '(3 + 4) * 2 ** 10 / sqrt(2)'.",
                "maxLength": MAX_EXPRESSION_CHARS,
            }
        },
        "required": ["expression"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        """Evaluate synchronously: every bound above keeps this to well under a millisecond."""
        expression = arguments.get("expression")
        try:
            value = self.evaluate(expression)  # type: ignore[arg-type]
        except CalculatorError as exc:
            return ToolResult.error(f"Error: {exc}", expression=str(expression)[:200])
        return ToolResult.ok(format_number(value), expression=expression)
