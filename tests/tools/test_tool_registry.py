"""ToolRegistry.execute never raises: every failure is an error ToolResult for the model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.waiting import WAIT_S, wait_for
from tools.base import Tool, ToolResult, validate_arguments
from tools.calculator import Calculator
from tools.registry import CLEANUP_GRACE_S, ToolRegistry


class EchoTool(Tool):
    name = "echo"
    description = "Echo the text n times."
    parameters = {
        "type": "object",
        "properties": {"text": {"type": "string"}, "n": {"type": "integer", "minimum": 1}},
        "required": ["text"],
        "additionalProperties": False,
    }

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        return ToolResult.ok(arguments["text"] * int(arguments.get("n", 1)))


class RaisingTool(EchoTool):
    name = "raising"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        raise self.exc


class HangingTool(EchoTool):
    """Ignores its timeout_s entirely: the registry's own deadline must stop it."""

    name = "hanging"

    def __init__(self) -> None:
        self.cancelled = False
        self.started = asyncio.Event()

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        self.started.set()
        try:
            await asyncio.sleep(3600)  # a hang, not a wait
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return ToolResult.ok("never")


class SleepingTool(EchoTool):
    name = "sleeping"

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        await asyncio.sleep(0.5)  # a slow tool, not a wait
        return ToolResult.ok("slept")


class WrongReturnTool(EchoTool):
    name = "wrong_return"

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        return "a bare string"  # type: ignore[return-value]


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry([EchoTool()])


async def test_valid_call_returns_the_tool_result(registry: ToolRegistry) -> None:
    result = await registry.execute("echo", {"text": "ab", "n": 2}, timeout_s=1)
    assert result == ToolResult.ok("abab")


async def test_arguments_as_json_string_are_parsed(registry: ToolRegistry) -> None:
    result = await registry.execute("echo", '{"text": "hi"}', timeout_s=1)
    assert result.content == "hi" and not result.is_error


async def test_unknown_tool_is_an_error_listing_the_tools(registry: ToolRegistry) -> None:
    result = await registry.execute("rm_rf", {}, timeout_s=1)
    assert result.is_error and "unknown tool 'rm_rf'" in result.content and "echo" in result.content


@pytest.mark.parametrize(
    "arguments",
    ['{"text": "hi"', "not json at all", "[1, 2]", '"a string"', "3", "null", 7, ["x"], None],
)
async def test_arguments_that_are_not_a_json_object_are_an_error(registry, arguments) -> None:
    result = await registry.execute("echo", arguments, timeout_s=1)
    assert result.is_error and result.metadata["failure"] == "bad_arguments"
    assert "invalid arguments for tool 'echo'" in result.content


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "missing required argument 'text'"),
        ({"text": 5}, "argument 'text' must be of type string"),
        ({"text": "a", "n": "2"}, "argument 'n' must be of type integer"),
        ({"text": "a", "n": True}, "argument 'n' must be of type integer"),
        ({"text": "a", "n": 0}, "argument 'n' must be >= 1"),
        ({"text": "a", "rm": 1}, "unknown argument(s): rm"),
    ],
)
async def test_arguments_violating_the_schema_are_an_error(registry, arguments, message) -> None:
    result = await registry.execute("echo", arguments, timeout_s=1)
    assert result.is_error and message in result.content


@pytest.mark.parametrize("exc", [ValueError("bad"), KeyError("k"), SystemExit(3), RecursionError()])
async def test_exception_inside_the_tool_is_an_error(exc: BaseException) -> None:
    registry = ToolRegistry([RaisingTool(exc)])
    result = await registry.execute("raising", {"text": "x"}, timeout_s=1)
    assert result.is_error and result.metadata["failure"] == "exception"
    assert type(exc).__name__ in result.content


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


async def test_exception_with_a_broken_str_is_still_an_error() -> None:
    result = await ToolRegistry([RaisingTool(UnprintableError())]).execute(
        "raising", {"text": "x"}, 1
    )
    assert result.is_error and "UnprintableError" in result.content


async def test_tool_with_a_broken_schema_is_an_error_not_an_exception() -> None:
    tool = EchoTool()
    tool.parameters = {"type": "object", "required": 5}  # not a list
    result = await ToolRegistry([tool]).execute("echo", {"text": "x"}, timeout_s=1)
    assert result.is_error and result.metadata["failure"] == "exception"


async def test_tool_ignoring_its_timeout_is_cancelled_by_the_registry() -> None:
    tool = HangingTool()
    registry = ToolRegistry([tool])
    started = time.monotonic()
    result = await registry.execute("hanging", {"text": "x"}, timeout_s=0.2)
    assert result.is_error and result.metadata["failure"] == "timeout"
    assert "timed out after 0.2 s" in result.content
    assert time.monotonic() - started < 0.2 + CLEANUP_GRACE_S + 0.5
    assert tool.cancelled


async def test_tool_returning_something_else_is_an_error() -> None:
    result = await ToolRegistry([WrongReturnTool()]).execute(
        "wrong_return", {"text": "x"}, timeout_s=1
    )
    assert result.is_error and result.metadata["failure"] == "bad_result"


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf"), "5", True])
async def test_invalid_timeout_is_an_error(registry: ToolRegistry, timeout_s: Any) -> None:
    result = await registry.execute("echo", {"text": "x"}, timeout_s=timeout_s)
    assert result.is_error and result.metadata["failure"] == "bad_timeout"


async def test_caller_cancellation_propagates() -> None:
    tool = HangingTool()
    registry = ToolRegistry([tool])
    call = asyncio.create_task(registry.execute("hanging", {"text": "x"}, timeout_s=60))
    await wait_for(tool.started.is_set, WAIT_S, "the tool to start")  # cancel the call while the tool runs
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_overlong_result_is_cut(registry: ToolRegistry) -> None:
    small = ToolRegistry([EchoTool()], max_content_chars=100)
    result = await small.execute("echo", {"text": "x", "n": 10_000}, timeout_s=1)
    assert len(result.content) < 150 and "9900 more characters cut" in result.content


async def test_calls_run_concurrently() -> None:
    registry = ToolRegistry([SleepingTool()])
    started = time.monotonic()
    results = await asyncio.gather(
        *(registry.execute("sleeping", {"text": ""}, 2) for _ in range(20))
    )
    assert all(r.content == "slept" for r in results)
    assert time.monotonic() - started < 1.5


def test_from_names_builds_builtin_tools_with_options() -> None:
    registry = ToolRegistry.from_names(["calculator", "python"], python={"wall_timeout_s": 3})
    assert registry.names == ["calculator", "python"]
    assert registry.get("python").config.wall_timeout_s == 3
    assert [s["function"]["name"] for s in registry.schemas()] == ["calculator", "python"]


def test_from_names_rejects_unknown_tools_and_stray_options() -> None:
    with pytest.raises(ValueError, match="unknown tool"):
        ToolRegistry.from_names(["calculator", "shell"])
    with pytest.raises(ValueError, match="not requested"):
        ToolRegistry.from_names(["calculator"], python={"wall_timeout_s": 3})


def test_duplicate_or_invalid_names_are_refused() -> None:
    registry = ToolRegistry([Calculator()])
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Calculator())
    bad = EchoTool()
    bad.name = "no spaces allowed"  # type: ignore[misc]
    with pytest.raises(ValueError, match="identifier"):
        registry.register(bad)


def test_registries_share_no_state() -> None:
    first, second = ToolRegistry([EchoTool()]), ToolRegistry()
    assert "echo" in first and "echo" not in second


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_validate_arguments_never_raises(value: Any) -> None:
    message = validate_arguments(EchoTool.parameters, value)
    assert message is None or isinstance(message, str)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60) | json_values)
def test_execute_never_raises_on_arbitrary_arguments(arguments: Any) -> None:
    registry = ToolRegistry([EchoTool(), Calculator()])
    for name in ("echo", "calculator"):
        result = asyncio.run(registry.execute(name, arguments, timeout_s=1))
        assert isinstance(result, ToolResult) and isinstance(result.content, str)
