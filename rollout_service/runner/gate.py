"""The pause gate agents wait on before every generate call."""

from __future__ import annotations

import asyncio


class Gate:
    """Open or closed; ``wait_open`` returns at once when open, else when it opens."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()
