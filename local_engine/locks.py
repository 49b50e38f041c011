"""The two asyncio primitives behind SGLang's generation/weight-update discipline.

- :class:`RWLock`: many readers (``/generate`` calls in flight) or one writer (a weight
  update). Writer-preferring: once a writer waits, new readers queue behind it, so an
  update cannot starve under steady traffic; it still waits for the readers already in.
- :class:`PauseGate`: closed while the engine is paused; ``/generate`` waits at the gate
  *before* taking the reader lock, exactly like SGLang, so a paused engine holds new
  requests until ``/continue_generation`` and never answers them with an error.

Both live on one event loop; neither is thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class RWLock:
    """Writer-preferring reader/writer lock for one event loop."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @property
    def readers(self) -> int:
        return self._readers

    @property
    def writers_waiting(self) -> int:
        return self._writers_waiting

    @asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # readers held back by this writer may go if it gave up
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class PauseGate:
    """Open unless paused. ``wait()`` returns at once when open."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.mode: str | None = None

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def close(self, mode: str) -> None:
        self.mode = mode
        self._open.clear()

    def open(self) -> None:
        self.mode = None
        self._open.set()

    async def wait(self) -> None:
        await self._open.wait()
