"""``/flush_cache?timeout=T`` as SGLang's scheduler answers it (``SchedulerFlushWrapper``, in
every release from 0.5.15 to 0.5.23, read from the wheels):

- ``T = 0`` (the default): flush now if :meth:`Engine.can_flush` (nothing running, nothing
  queued; from 0.5.21 a paused engine ignores its queue), else fail;
- ``T > 0``: flush at once when the scheduler is *fully idle* (nothing running and nothing
  queued, paused or not), else wait for it, checked once per scheduler loop, and fail with
  ``Timed out waiting for idle state.`` after ``T`` seconds. So a paused engine holding
  retracted requests never flushes this way: they stay queued until the engine continues;
- one deferred flush at a time: any flush while one waits fails with ``Another flush_cache is
  already in progress.``

Failures answer 400 with the message as plain text (SGLang's ``ret.message``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

CHECK_INTERVAL_S = 0.02  # SGLang checks a waiting flush once per scheduler loop iteration
FAILED = "Flush cache failed.\n"  # SGLang's text when the flush itself is refused (no message)
IN_PROGRESS = "Another flush_cache is already in progress."
TIMED_OUT = "Timed out waiting for idle state."


class CacheFlush:
    def __init__(self, can_flush: Callable[[], bool], fully_idle: Callable[[], bool],
                 flushed: Callable[[], None] = lambda: None) -> None:
        self._can_flush = can_flush
        self._fully_idle = fully_idle
        self._flushed = flushed
        """Called on every successful flush (the prefix cache is empty after it)."""
        self._waiting = False

    def _now(self) -> str | None:
        if not self._can_flush():
            return FAILED
        self._flushed()
        return None

    async def flush(self, timeout_s: float) -> str | None:
        """None when flushed, else SGLang's failure message (module docstring)."""
        if self._waiting:
            return IN_PROGRESS
        if timeout_s <= 0 or self._fully_idle():
            return self._now()
        self._waiting = True
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                await asyncio.sleep(CHECK_INTERVAL_S)
                if self._fully_idle():
                    return self._now()
            return TIMED_OUT
        finally:
            self._waiting = False
