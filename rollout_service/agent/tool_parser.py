"""Parsing tool calls out of model output.

``hermes`` (Qwen2.5 / Qwen3 / the builtin models): every call is a JSON object
``{"name": str, "arguments": object}`` between ``<tool_call>`` and ``</tool_call>``. Text
outside the tags is the assistant's content. A block that is not valid JSON, lacks a name,
or has non-object arguments becomes a :class:`ToolCall` with ``error`` set, so the agent can
answer the model with an error message instead of failing the episode. An unterminated
``<tool_call>`` (the turn ended mid-call) is reported the same way.

Call ids are deterministic (``call_<turn>_<index>``) so a resumed agent produces the same
ids as before its restart (results are idempotent by id).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
MAX_CALL_CHARS = 64_000  # a single call's JSON; larger is refused (bounded parsing work)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be parsed (None when it is well formed)."""

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry of this call (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


@dataclass
class ParsedTurn:
    content: str
    calls: list[ToolCall]


def parse_hermes(text: str, turn: int) -> ParsedTurn:
    """Split one assistant turn's text into content and tool calls."""
    calls: list[ToolCall] = []
    for i, match in enumerate(_BLOCK.finditer(text)):
        calls.append(_parse_call(match.group(1), f"call_{turn}_{i}"))
    content = _BLOCK.sub("", text)
    dangling = content.find(_OPEN)
    if dangling >= 0:
        calls.append(ToolCall(id=f"call_{turn}_{len(calls)}", name="", error="unterminated <tool_call> block"))
        content = content[:dangling]
    return ParsedTurn(content=content.strip(), calls=calls)


def _parse_call(raw: str, call_id: str) -> ToolCall:
    if len(raw) > MAX_CALL_CHARS:
        return ToolCall(id=call_id, name="", error=f"tool call longer than {MAX_CALL_CHARS} characters")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall(id=call_id, name="", error=f"tool call is not valid JSON: {exc.msg} at position {exc.pos}")
    if not isinstance(obj, dict):
        return ToolCall(id=call_id, name="", error="tool call must be a JSON object with name and arguments")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(id=call_id, name="", error="tool call has no \"name\"")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(id=call_id, name=name, error="tool call \"arguments\" is a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCall(id=call_id, name=name, error="tool call \"arguments\" must be a JSON object")
    return ToolCall(id=call_id, name=name, arguments=args)


PARSERS = {"hermes": parse_hermes}
