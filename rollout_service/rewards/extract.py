"""Cheap, pure-Python text checks on model output: the final ``\\boxed{...}`` answer, the
last number, and Hermes tool calls ``<tool_call>{json}</tool_call>``.

Contracts: every function here runs in time linear in the input (a few ms per MB), uses
bounded memory, never evaluates its input (only ``str`` scanning, ``re`` without nested
quantifiers, and ``json.loads`` of size-capped bodies), and never raises on any ``str``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

BOX_OPEN = "\\boxed{"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


@dataclass(frozen=True, slots=True)
class BoxedAnswer:
    """The last ``\\boxed{`` of a text: ``status`` is ``ok`` (``content`` holds the text
    between its braces), ``none`` (no box), ``unbalanced`` (never closed), ``too_long``
    (content over ``max_chars``) or ``too_deep`` (brace nesting over ``max_depth``)."""

    status: str
    content: str = ""
    count: int = 0  # how many ``\boxed{`` the text contains


def count_boxes(text: str) -> int:
    """Occurrences of ``\\boxed{`` in ``text``."""
    return text.count(BOX_OPEN)


def last_boxed(text: str, *, max_chars: int = 512, max_depth: int = 8) -> BoxedAnswer:
    """Find the last ``\\boxed{...}`` by brace matching; ``\\{`` and ``\\}`` are literal
    braces and do not nest. Scans at most ``max_chars + 1`` characters past the opening."""
    count = count_boxes(text)
    start = text.rfind(BOX_OPEN)
    if start < 0:
        return BoxedAnswer("none", count=0)
    i = start + len(BOX_OPEN)
    depth, end_limit = 1, min(len(text), i + max_chars + 1)
    j = i
    while j < end_limit:
        ch = text[j]
        if ch == "\\" and j + 1 < len(text) and text[j + 1] in "{}":
            j += 2
            continue
        if ch == "{":
            depth += 1
            if depth > max_depth:
                return BoxedAnswer("too_deep", count=count)
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return BoxedAnswer("ok", text[i:j], count=count)
        j += 1
    if end_limit < len(text):
        return BoxedAnswer("too_long", count=count)
    return BoxedAnswer("unbalanced", count=count)


def last_number(text: str, *, max_chars: int = 64) -> str | None:
    """The last integer/decimal in ``text`` (``-12``, ``9,197``, ``3.5``), commas removed;
    None when there is none or it is longer than ``max_chars``."""
    last = None
    for last in _NUMBER.finditer(text):  # noqa: B007 - we want the final match
        pass
    if last is None or len(last.group()) > max_chars:
        return None
    return last.group().replace(",", "")


@dataclass(frozen=True, slots=True)
class ToolCallCheck:
    """Result of :func:`check_tool_calls`: ``calls`` well-formed blocks, ``bad`` malformed
    ones (invalid JSON, not ``{"name": str, "arguments": object}``, oversized, unclosed or
    stray closing tags); ``ok`` is True when ``bad == 0``."""

    calls: int
    bad: int
    names: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.bad == 0


def check_tool_calls(text: str, *, max_calls: int = 64, max_body_chars: int = 16384) -> ToolCallCheck:
    """Validate every ``<tool_call>...</tool_call>`` block of ``text`` (Hermes format, as in
    the builtin chat template). Blocks past ``max_calls`` count as bad."""
    calls = bad = 0
    names: list[str] = []
    pos = 0
    while True:
        open_at = text.find(TOOL_OPEN, pos)
        stray_close = text.find(TOOL_CLOSE, pos)
        if open_at < 0:
            if stray_close >= 0:
                bad += text.count(TOOL_CLOSE, pos)
            break
        if 0 <= stray_close < open_at:
            bad += text.count(TOOL_CLOSE, pos, open_at)
        body_start = open_at + len(TOOL_OPEN)
        close_at = text.find(TOOL_CLOSE, body_start)
        if close_at < 0:
            bad += 1
            break
        body = text[body_start:close_at]
        pos = close_at + len(TOOL_CLOSE)
        if TOOL_OPEN in body or len(body) > max_body_chars or calls + bad >= max_calls:
            bad += 1
            continue
        name = _tool_call_name(body)
        if name is None:
            bad += 1
        else:
            calls += 1
            names.append(name)
    return ToolCallCheck(calls=calls, bad=bad, names=tuple(names))


def _tool_call_name(body: str) -> str | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name, args = obj.get("name"), obj.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name
