"""Format reward, and its weighted combination with the math checker.

:class:`FormatReward` scores 1.0 when the response is well-formed, else 0.0. Well-formed
means, for each enabled check:

- ``require_single_box``: exactly one ``\\boxed{`` in the text, balanced, non-empty, within
  the length/nesting limits;
- ``check_tool_calls``: every ``<tool_call>...</tool_call>`` block holds a JSON object
  ``{"name": str, "arguments": object}`` and no tag is unpaired, and there are at least
  ``min_tool_calls`` such calls.

Details: ``format_ok`` (bool), ``boxes`` (float count), ``box_ok`` (bool), ``tool_calls``
and ``bad_tool_calls`` (float counts), ``tool_calls_ok`` (bool). Pure Python, linear time,
no subprocess.

:class:`CombinedReward`: ``score = correct_weight * correct + format_weight * format_ok``
(defaults 1.0 and 0.1). Its details keep both components: ``correct``, ``format_ok``,
``score_correct``, ``score_format`` and every component detail prefixed ``math.`` or
``format.``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import RewardResult
from .extract import check_tool_calls, count_boxes, last_boxed
from .math_reward import INLINE_SCAN_CHARS, MathReward


@dataclass(frozen=True)
class FormatConfig:
    require_single_box: bool = True
    check_tool_calls: bool = False
    min_tool_calls: int = 0
    max_answer_chars: int = 512
    max_brace_depth: int = 8


class FormatReward:
    """A cheap synchronous :class:`~.base.RewardFn`; see the module doc."""

    def __init__(self, config: FormatConfig | None = None) -> None:
        self.config = config or FormatConfig()

    def check(self, response_text: str) -> dict[str, Any]:
        """The detail dict for ``response_text`` (``format_ok`` is the verdict)."""
        cfg = self.config
        if not isinstance(response_text, str):
            return {"format_ok": False, "boxes": 0.0, "box_ok": False, "tool_calls": 0.0,
                    "bad_tool_calls": 0.0, "tool_calls_ok": False}
        box = last_boxed(response_text, max_chars=cfg.max_answer_chars, max_depth=cfg.max_brace_depth)
        boxes = count_boxes(response_text)
        box_ok = boxes == 1 and box.status == "ok" and bool(box.content.strip())
        calls = check_tool_calls(response_text)
        tools_ok = calls.ok and calls.calls >= cfg.min_tool_calls
        ok = (box_ok or not cfg.require_single_box) and (tools_ok or not cfg.check_tool_calls)
        return {"format_ok": ok, "boxes": float(boxes), "box_ok": box_ok, "tool_calls": float(calls.calls),
                "bad_tool_calls": float(calls.bad), "tool_calls_ok": tools_ok}

    def __call__(self, response_text: str, ground_truth: Any = None, extra_info: Mapping[str, Any] | None = None) -> RewardResult:
        details = self.check(response_text)
        return RewardResult(1.0 if details["format_ok"] else 0.0, details)


class CombinedReward:
    """``correct_weight * math correct + format_weight * format_ok``; see the module doc."""

    def __init__(
        self, math: MathReward, fmt: FormatReward | None = None, *,
        format_weight: float = 0.1, correct_weight: float = 1.0,
    ) -> None:
        self.math = math
        self.format = fmt or FormatReward()
        self.format_weight = format_weight
        self.correct_weight = correct_weight

    def _combine(self, math_result: RewardResult, fmt_details: dict[str, Any]) -> RewardResult:
        correct = bool(math_result.details.get("correct", False))
        fmt_ok = bool(fmt_details["format_ok"])
        s_correct = self.correct_weight * float(correct)
        s_format = self.format_weight * float(fmt_ok)
        details: dict[str, Any] = {"correct": correct, "format_ok": fmt_ok,
                                   "score_correct": s_correct, "score_format": s_format}
        details.update({f"math.{k}": v for k, v in math_result.details.items()})
        details.update({f"format.{k}": v for k, v in fmt_details.items()})
        return RewardResult(s_correct + s_format, details, failed=math_result.failed)

    def __call__(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> RewardResult:
        return self._combine(self.math(response_text, ground_truth, extra_info), self.format.check(response_text))

    async def score(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> RewardResult:
        math_result = await self.math.score(response_text, ground_truth, extra_info)
        if isinstance(response_text, str) and len(response_text) > INLINE_SCAN_CHARS:
            fmt_details = await asyncio.to_thread(self.format.check, response_text)
        else:
            fmt_details = self.format.check(response_text)
        return self._combine(math_result, fmt_details)
