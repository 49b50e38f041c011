"""The math answer checker: the final ``\\boxed{...}`` of a response compared with the
ground truth by math-verify (symbolic and numeric equivalence).

Scoring: ``1.0`` when the extracted answer is equivalent to the ground truth (or to any
element when the ground truth is a list), else ``0.0``. Details (always all present):

- ``extracted`` (str, first 200 chars of the answer text, "" when none),
- ``correct`` (bool), ``format_ok`` (bool: a balanced last ``\\boxed{}`` within limits),
- ``answer_source`` (``boxed`` | ``last_number`` | ``none``),
- ``reason`` (``ok``, ``wrong``, ``no_answer``, ``unbalanced``, ``too_long``, ``too_deep``,
  ``unparsable``, ``bad_ground_truth``, ``timeout``, ``worker_crashed``, ``error``,
  ``not_text``), ``timeout`` (bool), ``checked_by`` (``fast_int`` | ``math_verify`` | ``none``),
  ``verify_ms`` (float).

Extraction: only the *last* ``\\boxed{}`` counts (earlier boxes are ignored, so a model
that boxes intermediate results is judged on its final one). With
``fallback_last_number=True`` a response without any box is judged on its last number
(``format_ok`` stays False). Answers over ``max_answer_chars`` or nested deeper than
``max_brace_depth`` score 0 without being parsed.

Cost: when both answer and ground truth are plain integers the comparison is exact and
in-process (microseconds); everything else goes to a :class:`~.math_pool.VerifyPool`
worker process (see docs/data_and_rewards.md for measured numbers). Model output is never
evaluated: math-verify is used with LaTeX extraction only (its plain-expression mode
would call sympy's ``parse_expr``, which uses ``eval``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .base import RewardResult
from .extract import last_boxed, last_number
from .math_pool import VerifyOutcome, VerifyPool

INLINE_SCAN_CHARS = 65536  # longer responses are scanned off the event loop (~2 ms per MB)
_PLAIN_INT = re.compile(r"-?\d{1,4000}")  # int() refuses more than 4300 digits


@dataclass(frozen=True)
class MathRewardConfig:
    """Knobs of :class:`MathReward`; the defaults suit the demo task and verl math sets."""

    timeout_s: float = 5.0
    fallback_last_number: bool = False
    max_answer_chars: int = 512
    max_brace_depth: int = 8
    workers: int = 2
    max_memory_mb: int = 1024
    fast_integer_path: bool = True


def gold_latex(ground_truth: Any) -> list[str]:
    """The ground truth as LaTeX strings math-verify can parse: numbers and bare strings are
    wrapped in ``\\boxed{}``; strings already holding ``$`` or ``\\boxed`` are kept; lists
    and tuples give one entry per element. Anything else gives ``[]``."""
    if isinstance(ground_truth, (list, tuple)):
        return [g for item in ground_truth for g in gold_latex(item)]
    if isinstance(ground_truth, bool) or ground_truth is None:
        return []
    if isinstance(ground_truth, (int, float)):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        return []
    text = ground_truth.strip()
    return [text if ("$" in text or "\\boxed" in text) else "\\boxed{" + text + "}"]


def _plain_int(text: str) -> int | None:
    compact = text.replace(" ", "").replace(",", "")
    if compact.startswith("\\boxed{") and compact.endswith("}"):
        compact = compact[7:-1]
    return int(compact) if _PLAIN_INT.fullmatch(compact) else None


class MathReward:
    """A :class:`~.base.RewardFn` (blocking ``__call__``, any thread) with a non-blocking
    ``async def score``. Owns a :class:`VerifyPool` unless one is passed in; call
    :meth:`close` (or use ``with``) to stop its workers."""

    def __init__(self, config: MathRewardConfig | None = None, *, pool: VerifyPool | None = None) -> None:
        self.config = config or MathRewardConfig()
        self._own_pool = pool is None
        self.pool = pool or VerifyPool(
            self.config.workers, timeout_s=self.config.timeout_s, max_memory_mb=self.config.max_memory_mb
        )

    def _prepare(self, response_text: Any, ground_truth: Any) -> tuple[RewardResult | None, str, list[str], dict]:
        cfg = self.config
        details: dict[str, Any] = {
            "extracted": "", "correct": False, "format_ok": False, "answer_source": "none",
            "reason": "no_answer", "timeout": False, "checked_by": "none", "verify_ms": 0.0,
        }
        if not isinstance(response_text, str):
            details["reason"] = "not_text"
            return RewardResult(0.0, details), "", [], details
        golds = gold_latex(ground_truth)
        if not golds:
            details["reason"] = "bad_ground_truth"
            return RewardResult(0.0, details), "", [], details
        box = last_boxed(response_text, max_chars=cfg.max_answer_chars, max_depth=cfg.max_brace_depth)
        if box.status == "ok" and box.content.strip():
            answer, details["answer_source"], details["format_ok"] = box.content, "boxed", True
        elif box.status == "none" and cfg.fallback_last_number:
            number = last_number(response_text)
            if number is None:
                return RewardResult(0.0, details), "", [], details
            answer, details["answer_source"] = number, "last_number"
        else:
            details["reason"] = box.status if box.status in ("unbalanced", "too_long", "too_deep") else "no_answer"
            return RewardResult(0.0, details), "", [], details
        details["extracted"] = answer[:200]
        if cfg.fast_integer_path and len(golds) == 1:
            got, want = _plain_int(answer), _plain_int(golds[0])
            if got is not None and want is not None:
                outcome = VerifyOutcome("ok", correct=got == want, pred_parsed=True, gold_parsed=True)
                return self._finish(outcome, details, "fast_int"), "", [], details
        return None, "\\boxed{" + answer + "}", golds, details

    @staticmethod
    def _finish(outcome: VerifyOutcome, details: dict[str, Any], checked_by: str = "math_verify") -> RewardResult:
        details = dict(details, checked_by=checked_by, verify_ms=round(outcome.elapsed_ms, 3))
        if outcome.status == "ok":
            details["correct"] = outcome.correct
            if outcome.correct:
                details["reason"] = "ok"
            elif outcome.soft_timeout:
                details.update(reason="timeout", timeout=True)
            elif not outcome.gold_parsed:
                details["reason"] = "bad_ground_truth"
            elif not outcome.pred_parsed:
                details["reason"] = "unparsable"
            else:
                details["reason"] = "wrong"
        elif outcome.status == "timeout":
            details.update(reason="timeout", timeout=True)
        else:
            details["reason"] = "worker_crashed" if outcome.status == "crashed" else "error"
            details["error"] = outcome.error[:200]
        # The pool itself failing (closed, no worker could start) says nothing about the
        # answer: an infrastructure failure. A timeout or a worker dying on this answer does.
        return RewardResult(1.0 if details["correct"] else 0.0, details, failed=outcome.status == "error")

    def __call__(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> RewardResult:
        """Blocking; bounded by the pool's timeout (plus the wait for a free worker)."""
        early, pred, golds, details = self._prepare(response_text, ground_truth)
        if early is not None:
            return early
        return self._finish(self.pool.verify(pred, golds), details)

    async def score(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> RewardResult:
        """Non-blocking variant of :meth:`__call__` for the event loop (texts over
        ``INLINE_SCAN_CHARS`` are scanned in a thread, not on the loop)."""
        if isinstance(response_text, str) and len(response_text) > INLINE_SCAN_CHARS:
            early, pred, golds, details = await asyncio.to_thread(self._prepare, response_text, ground_truth)
        else:
            early, pred, golds, details = self._prepare(response_text, ground_truth)
        if early is not None:
            return early
        return self._finish(await self.pool.averify(pred, golds), details)

    def start(self) -> None:
        """Warm the worker processes now instead of on the first slow-path call."""
        self.pool.start()

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> MathReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
