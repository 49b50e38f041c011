"""An asyncio event loop in a daemon thread, for rank 0's network I/O while training runs.

The training loop is plain synchronous torch code in the main thread. NATS (fetch, acks,
in-progress heartbeats, metrics), the engines' and the sync agent's HTTP calls and the
weight broadcast run as coroutines on this loop, so a long step never starves a heartbeat
and a weight sync never blocks training.

Contract: ``run(coro, timeout_s)`` blocks the caller until the coroutine finishes (raises its
exception, or ``TimeoutError`` after ``timeout_s`` — the coroutine is then cancelled);
``submit(coro)`` returns a ``concurrent.futures.Future`` at once. Every piece of state the
coroutines touch is owned by the loop thread; the main thread only reaches it through
``run``/``submit``. ``close()`` cancels what is left and joins the thread (bounded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_JOIN_S = 10.0  # cancelled tasks get this long to unwind (close NATS, sockets)


class IoLoop:
    """See the module docstring."""

    def __init__(self, name: str = "trainer-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None) -> T:
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine's own TimeoutError (the same class since Python 3.11)
                raise
            fut.cancel()
            raise TimeoutError(f"I/O operation did not finish within {timeout_s} s") from None

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_cancel_all(), CLOSE_JOIN_S)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.warning("io loop: cancelling tasks failed: %s", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_JOIN_S)
        if not self._thread.is_alive():
            self.loop.close()
