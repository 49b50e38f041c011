"""Text extraction helpers, the format reward, and the weighted combination with math."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rollout_service.rewards import (
    CombinedReward,
    FormatConfig,
    FormatReward,
    MathReward,
    VerifyPool,
    check_tool_calls,
    last_boxed,
    last_number,
)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "317 * 29 + 4"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "status", "content"), [
    (r"\boxed{42}", "ok", "42"),
    (r"a \boxed{1} b \boxed{\frac{1}{2}} c", "ok", r"\frac{1}{2}"),
    (r"\boxed{\{1, 2\}}", "ok", r"\{1, 2\}"),  # escaped braces do not nest
    (r"\boxed{\left\{ x \right.}", "ok", r"\left\{ x \right."),
    ("no box", "none", ""),
    (r"\boxed{12", "unbalanced", ""),
    (r"\boxed{" + "1" * 600 + "}", "too_long", ""),
    (r"\boxed{" + "{" * 8 + "1" + "}" * 8 + "}", "too_deep", ""),
    (r"\boxed{" + "{" * 6 + "1" + "}" * 6 + "}", "ok", "{" * 6 + "1" + "}" * 6),
])
def test_last_boxed(text: str, status: str, content: str) -> None:
    box = last_boxed(text)
    assert (box.status, box.content) == (status, content)


@pytest.mark.parametrize(("text", "expected"), [
    ("it is 42", "42"), ("-3 and then 7.25.", "7.25"), ("total 9,197 apples", "9197"),
    ("none", None), ("x" + "9" * 100, None),
])
def test_last_number(text: str, expected: str | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(("text", "calls", "bad"), [
    (CALL, 1, 0),
    (CALL + " then " + CALL, 2, 0),
    ("no calls", 0, 0),
    ("<tool_call>{not json}</tool_call>", 0, 1),
    ('<tool_call>{"name": "calculator"}</tool_call>', 0, 1),  # arguments missing
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 0, 1),
    ('<tool_call>["calculator", {}]</tool_call>', 0, 1),
    ('<tool_call>{"name": "c", "arguments": "1+1"}</tool_call>', 0, 1),
    ("<tool_call>" + CALL[len("<tool_call>"):-len("</tool_call>")], 0, 1),  # never closed
    (CALL + "</tool_call>", 1, 1),  # stray closing tag
    ("</tool_call>" + CALL, 1, 1),
    ("<tool_call><tool_call>{}</tool_call>", 0, 1),  # nested opening tag
])
def test_check_tool_calls(text: str, calls: int, bad: int) -> None:
    check = check_tool_calls(text)
    assert (check.calls, check.bad, check.ok) == (calls, bad, bad == 0)
    if calls:
        assert check.names[0] == "calculator"


@pytest.mark.parametrize(("text", "cfg", "ok"), [
    (r"so \boxed{5}", FormatConfig(), True),
    (r"\boxed{4} no, \boxed{5}", FormatConfig(), False),  # exactly one box required
    ("5", FormatConfig(), False),
    (r"\boxed{}", FormatConfig(), False),
    (r"\boxed{ }", FormatConfig(), False),
    (CALL + r" \boxed{9197}", FormatConfig(check_tool_calls=True, min_tool_calls=1), True),
    (r"\boxed{9197}", FormatConfig(check_tool_calls=True, min_tool_calls=1), False),
    (r"\boxed{9197}", FormatConfig(check_tool_calls=True), True),
    ("<tool_call>{}</tool_call>" + r"\boxed{1}", FormatConfig(check_tool_calls=True), False),
    ("<tool_call>{}</tool_call>", FormatConfig(require_single_box=False), True),
])
def test_format_reward(text: str, cfg: FormatConfig, ok: bool) -> None:
    r = FormatReward(cfg)(text, None, {})
    assert r.score == (1.0 if ok else 0.0) and r.details["format_ok"] is ok


@pytest.fixture(scope="module")
def math() -> Iterator[MathReward]:
    with VerifyPool(1, timeout_s=5.0) as pool:
        yield MathReward(pool=pool)


@pytest.mark.parametrize(("text", "truth", "correct", "fmt_ok"), [
    (CALL + r" \boxed{9197}", "9197", True, True),
    (r"\boxed{9197}", "9197", True, False),  # no tool call
    (CALL + r" \boxed{9}", "9197", False, True),
    (CALL + r" \boxed{1} \boxed{9197}", "9197", True, False),  # two boxes
    ("nothing", "9197", False, False),
])
async def test_combined_reward(math: MathReward, text: str, truth: str, correct: bool, fmt_ok: bool) -> None:
    fmt = FormatReward(FormatConfig(check_tool_calls=True, min_tool_calls=1))
    combined = CombinedReward(math, fmt, format_weight=0.25)
    expected = float(correct) + 0.25 * float(fmt_ok)
    for r in (combined(text, truth, {}), await combined.score(text, truth, {})):
        assert r.score == pytest.approx(expected)
        assert (r.details["correct"], r.details["format_ok"]) == (correct, fmt_ok)
        assert r.details["score_correct"] == float(correct)
        assert r.details["score_format"] == pytest.approx(0.25 * fmt_ok)
        assert r.details["math.correct"] is correct and r.details["format.format_ok"] is fmt_ok
    weighted = CombinedReward(math, fmt, format_weight=0.0, correct_weight=2.0)
    assert weighted(text, truth, {}).score == 2.0 * correct
