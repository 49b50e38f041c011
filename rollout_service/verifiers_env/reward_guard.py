"""A reward function that raises is a crash, not a zero: :func:`guard_rubric`, :func:`recording`.

verifiers' ``Rubric`` scores a reward function that raises as 0.0 and only logs it, so a
broken function would silently teach the policy that every answer is wrong. asyncrl never
trains on an infrastructure failure: :func:`guard_rubric` wraps every function of an
environment's rubric (nested ``RubricGroup``s included; names and signatures kept, so
verifiers still tells group functions from per-rollout ones) so that a raise is also
recorded, and the driver scores each group inside :func:`recording`: a group in which any
function raised is published as ``reward_error`` (never trained), with the first error.

Contract and limits: the record is per asyncio context (a ``ContextVar``), so groups scored
concurrently do not see each other's failures; the whole group is marked, because verifiers'
error path does not say which member's call raised.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from contextvars import ContextVar

_failures: ContextVar[list[str] | None] = ContextVar("asyncrl_verifiers_reward_failures", default=None)
GUARDED = "__asyncrl_guarded__"


def _guard(func):
    if getattr(func, GUARDED, False):
        return func

    @functools.wraps(func)
    async def guarded(*args, **kwargs):
        try:
            out = func(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except Exception as exc:
            failures = _failures.get()
            if failures is not None:
                failures.append(f"{getattr(func, '__name__', 'reward function')}: {type(exc).__name__}: {exc}"[:300])
            raise

    setattr(guarded, GUARDED, True)
    return guarded


def guard_rubric(rubric) -> int:
    """Wrap every reward function of ``rubric`` in place; returns how many there are."""
    if hasattr(rubric, "rubrics"):
        return sum(guard_rubric(r) for r in rubric.rubrics)
    rubric.funcs = [_guard(f) for f in rubric.funcs]
    return len(rubric.funcs)


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """The failures of the guarded functions called inside the block (this context only)."""
    failures: list[str] = []
    token = _failures.set(failures)
    try:
        yield failures
    finally:
        _failures.reset(token)
