"""Reward interfaces: :class:`RewardResult`, the :class:`RewardFn` protocol, and the
per-instance :class:`RewardRegistry` that picks a function by ``data_source``.

Contracts:

- A reward function is called as ``fn(response_text, ground_truth, extra_info)`` and
  returns a :class:`RewardResult`. It may additionally offer ``async def score(...)`` with
  the same arguments (:class:`AsyncRewardFn`); :func:`score_async` prefers it and otherwise
  runs the sync call in a worker thread, so the event loop is never blocked.
- :func:`score_async` and :meth:`RewardRegistry.score` never raise for a bad sample: an
  exception inside a reward function becomes ``score=0.0`` with ``details["error"]`` and
  ``failed=True`` (the trajectory is then never trained: ``Trajectory.failure``).
  (A data source with no reward function is a configuration error and does raise
  ``LookupError``.)
- ``response_text`` is the text the policy produced for the episode (all assistant turns,
  with tool calls); functions must treat it as hostile: never ``eval``/``exec`` it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import inspect
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

Detail = float | str | bool


@dataclass(frozen=True, slots=True)
class RewardResult:
    """A scalar reward and flat diagnostics. ``score`` must be finite; detail values are
    float, str or bool (ints are converted to float, other types raise ``TypeError``)."""

    score: float
    details: Mapping[str, Detail] = field(default_factory=dict)
    failed: bool = False
    """True when the reward function crashed (the score is then a placeholder 0.0): an
    infrastructure failure, so the trajectory is marked ``reward_error`` and never trained."""

    def __post_init__(self) -> None:
        score = float(self.score)
        if not math.isfinite(score):
            raise ValueError(f"reward score must be finite, got {score}")
        clean: dict[str, Detail] = {}
        for key, value in self.details.items():
            if isinstance(value, (bool, str, float)):
                clean[str(key)] = value
            elif isinstance(value, int):
                clean[str(key)] = float(value)
            else:
                raise TypeError(f"reward detail {key!r} has type {type(value).__name__}; use float, str or bool")
        object.__setattr__(self, "score", score)
        object.__setattr__(self, "details", clean)


@runtime_checkable
class RewardFn(Protocol):
    """``(response_text, ground_truth, extra_info) -> RewardResult``; blocking is allowed."""

    def __call__(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any]) -> RewardResult: ...


@runtime_checkable
class AsyncRewardFn(Protocol):
    """A reward function with a non-blocking coroutine variant."""

    async def score(self, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any]) -> RewardResult: ...


def _error_result(exc: BaseException) -> RewardResult:
    return RewardResult(0.0, {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}, failed=True)


async def score_async(fn: Any, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any]) -> RewardResult:
    """Score with ``fn`` without blocking the running loop (see the module doc)."""
    try:
        coro = getattr(fn, "score", None)
        if coro is not None and inspect.iscoroutinefunction(coro):
            result = await coro(response_text, ground_truth, extra_info)
        else:
            result = await asyncio.to_thread(fn, response_text, ground_truth, extra_info)
        if not isinstance(result, RewardResult):
            raise TypeError(f"reward function returned {type(result).__name__}, not RewardResult")
        return result
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.warning("reward function %r failed: %s", fn, exc)
        return _error_result(exc)


def _is_pattern(key: str) -> bool:
    return any(ch in key for ch in "*?[")


class RewardRegistry:
    """Maps ``data_source`` to a reward function: an exact key first, then glob patterns
    (``fnmatch`` syntax, case-sensitive, e.g. ``"asyncrl/*"``) in registration order, then
    ``default``. Each instance has its own table; nothing is global."""

    def __init__(self, default: RewardFn | None = None) -> None:
        self._exact: dict[str, RewardFn] = {}
        self._patterns: list[tuple[str, RewardFn]] = []
        self.default = default

    def register(self, key: str, fn: RewardFn, *, replace: bool = False) -> None:
        """Register ``fn`` for a data source, or for a glob when ``key`` has ``*?[``.
        Registering the same key twice raises ``ValueError`` unless ``replace``."""
        if not callable(fn):
            raise TypeError("reward function must be callable")
        if _is_pattern(key):
            existing = [i for i, (k, _) in enumerate(self._patterns) if k == key]
            if existing and not replace:
                raise ValueError(f"reward pattern {key!r} already registered")
            if existing:
                self._patterns[existing[0]] = (key, fn)
            else:
                self._patterns.append((key, fn))
        else:
            if key in self._exact and not replace:
                raise ValueError(f"reward for data_source {key!r} already registered")
            self._exact[key] = fn

    def resolve(self, data_source: str) -> RewardFn:
        """The function for ``data_source``; ``LookupError`` when nothing matches."""
        fn = self._exact.get(data_source)
        if fn is not None:
            return fn
        for pattern, pfn in self._patterns:
            if fnmatch.fnmatchcase(data_source, pattern):
                return pfn
        if self.default is not None:
            return self.default
        raise LookupError(f"no reward function for data_source {data_source!r} and no default")

    def __contains__(self, data_source: str) -> bool:
        try:
            self.resolve(data_source)
        except LookupError:
            return False
        return True

    def __call__(
        self, data_source: str, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
    ) -> RewardResult:
        """Blocking scoring; exceptions of the function become score 0 (see module doc)."""
        fn = self.resolve(data_source)
        try:
            result = fn(response_text, ground_truth, extra_info or {})
            if not isinstance(result, RewardResult):
                raise TypeError(f"reward function returned {type(result).__name__}, not RewardResult")
            return result
        except Exception as exc:
            logger.warning("reward function for %r failed: %s", data_source, exc)
            return _error_result(exc)

    async def score(
        self, data_source: str, response_text: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
    ) -> RewardResult:
        """Non-blocking scoring through :func:`score_async`."""
        return await score_async(self.resolve(data_source), response_text, ground_truth, extra_info or {})
