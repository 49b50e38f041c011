"""A registry of tools by name, and the one place where tool calls are executed.

``ToolRegistry.execute(name, arguments, timeout_s)`` is the entry point for the agent
runner. Its contract: it **never raises** (except ``CancelledError`` when the caller
itself is cancelled) and returns within ``timeout_s + CLEANUP_GRACE_S``. Every failure
becomes a :class:`~tools.base.ToolResult` with ``is_error=True`` and a short message
that can be shown to the model as the tool's answer:

- unknown tool name;
- arguments that are not a JSON object (an unparsable string, a list, a number, ...);
- arguments that do not fit the tool's schema (missing or mistyped keys);
- an exception raised inside the tool (including ``SystemExit``); the traceback is logged,
  only ``ExceptionType: message`` reaches the model;
- a tool that overruns its timeout: it is cancelled and the caller gets a timeout result.

Arguments may be given as a dict or as the JSON string that OpenAI-style tool calls carry.
Results longer than ``max_content_chars`` are cut (so one tool cannot flood the context).

Registries are plain instances (no module-level registry): build one per agent runner
with :meth:`ToolRegistry.from_names`, e.g.::

    registry = ToolRegistry.from_names(["calculator", "python"], python={"wall_timeout_s": 5})
    result = await registry.execute("python", '{"code": "print(6*7)"}', timeout_s=10)

Not covered: per-call rate limits or quotas, retries, idempotency by ``call_id`` (the
runner's job), and tools that ignore cancellation (a tool blocking the event loop in
synchronous code cannot be interrupted by anyone).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tools.base import Tool, ToolResult

logger = logging.getLogger(__name__)

# Time a tool gets beyond timeout_s to kill its processes and delete its files before the
# registry stops waiting for it (tools are asked to finish within timeout_s themselves).
CLEANUP_GRACE_S = 2.0
# Longest tool answer passed to the model: about 8k tokens; longer answers are cut.
DEFAULT_MAX_CONTENT_CHARS = 32_000
# Cap on the exception text shown to the model when a tool raises.
MAX_EXCEPTION_MESSAGE_CHARS = 500


def _builtin_factories() -> dict[str, Callable[..., Tool]]:
    """Constructors of the tools shipped in this package, by tool name (imported lazily)."""
    from tools.calculator import Calculator
    from tools.estimate import Estimate
    from tools.python_sandbox import PythonSandbox

    return {Calculator.name: Calculator, Estimate.name: Estimate, PythonSandbox.name: PythonSandbox}


def _parse_arguments(arguments: Any) -> dict[str, Any] | str:
    """The arguments as a dict, or a message saying why they are not a JSON object."""
    if isinstance(arguments, (str, bytes, bytearray)):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as exc:
            return f"arguments are not valid JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    return arguments


def _describe(exc: BaseException) -> str:
    """``Type: message``, short, even for exceptions whose ``__str__`` fails."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001 - a broken __str__ must not escape execute()
        text = type(exc).__name__
    return text[:MAX_EXCEPTION_MESSAGE_CHARS]


class ToolRegistry:
    """Tools by name, their schemas for the chat template, and safe execution."""

    def __init__(
        self, tools: Iterable[Tool] = (), *, max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS
    ) -> None:
        if max_content_chars < 100:
            raise ValueError("max_content_chars must be at least 100")
        self._tools: dict[str, Tool] = {}
        self.max_content_chars = max_content_chars
        for tool in tools:
            self.register(tool)

    @classmethod
    def from_names(
        cls,
        names: Iterable[str],
        *,
        max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS,
        **options: Mapping[str, Any],
    ) -> ToolRegistry:
        """A registry with the named builtin tools; ``options[name]`` are that tool's kwargs.

        Raises ValueError for an unknown name or options for a tool not listed: this is
        configuration, checked at startup, not a model mistake.
        """
        names = list(names)
        factories = _builtin_factories()
        unknown = [n for n in names if n not in factories]
        if unknown:
            raise ValueError(f"unknown tool(s) {unknown}; builtin tools: {sorted(factories)}")
        stray = sorted(set(options) - set(names))
        if stray:
            raise ValueError(f"options given for tool(s) not requested: {stray}")
        return cls(
            (factories[n](**dict(options.get(n, {}))) for n in names),
            max_content_chars=max_content_chars,
        )

    def register(self, tool: Tool) -> None:
        """Add ``tool``; raises ValueError if its name is taken or not a valid function name."""
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name or not name.replace("_", "a").isalnum():
            raise ValueError(f"tool name must be a non-empty identifier, got {name!r}")
        if name in self._tools:
            raise ValueError(f"a tool named {name!r} is already registered")
        self._tools[name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI function schemas of all tools, in registration order."""
        return [tool.schema() for tool in self._tools.values()]

    async def execute(self, name: str, arguments: Any, timeout_s: float) -> ToolResult:
        """Run tool ``name`` on ``arguments``; never raises (see the module docstring)."""
        started = time.monotonic()
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None:
            available = ", ".join(self._tools) or "none"
            return ToolResult.error(
                f"Error: unknown tool {str(name)[:100]!r}. Available tools: {available}.",
                tool=name,
                failure="unknown_tool",
            )
        if (
            not isinstance(timeout_s, (int, float))
            or isinstance(timeout_s, bool)
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            return ToolResult.error(
                f"Error: invalid timeout {timeout_s!r} for tool '{name}'.",
                tool=name,
                failure="bad_timeout",
            )
        parsed = _parse_arguments(arguments)
        deadline = asyncio.timeout(timeout_s + CLEANUP_GRACE_S)
        try:
            problem = parsed if isinstance(parsed, str) else tool.validate(parsed)
            if problem is not None:
                return ToolResult.error(
                    f"Error: invalid arguments for tool '{name}': {problem}.",
                    tool=name,
                    failure="bad_arguments",
                )
            async with deadline:
                result = await tool.call(parsed, timeout_s=float(timeout_s))
        except (Exception, SystemExit) as exc:  # a tool bug must not crash the agent runner
            if isinstance(exc, TimeoutError) and deadline.expired():
                return ToolResult.error(
                    f"Error: tool '{name}' timed out after {timeout_s:g} s.",
                    tool=name,
                    failure="timeout",
                    elapsed_s=round(time.monotonic() - started, 3),
                )
            logger.exception("tool %r raised", name)
            return ToolResult.error(
                f"Error: tool '{name}' failed: {_describe(exc)}",
                tool=name,
                failure="exception",
                exception=type(exc).__name__,
            )
        if not isinstance(result, ToolResult) or not isinstance(result.content, str):
            logger.error("tool %r returned %r instead of a ToolResult", name, type(result))
            return ToolResult.error(
                f"Error: tool '{name}' returned no result.", tool=name, failure="bad_result"
            )
        return self._cap(result)

    def _cap(self, result: ToolResult) -> ToolResult:
        content = result.content
        if len(content) <= self.max_content_chars:
            return result
        dropped = len(content) - self.max_content_chars
        cut = content[: self.max_content_chars] + f"\n[... {dropped} more characters cut]"
        return ToolResult(cut, result.is_error, {**result.metadata, "content_cut_chars": dropped})
