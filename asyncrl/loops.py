"""The background loops of one service, supervised: none dies silently, all stop together.

    loops = LoopSupervisor("the rollout service", restart_s=1.0)
    loops.every("metrics", 5.0, publish_metrics)       # a body run at once, then every 5 s
    loops.spawn("engine-health", pool.health_loop)      # a long-running loop(stop_event)
    ...
    await loops.stop()                                  # sets the stop event, waits for all

Contract:

- Each loop runs until :meth:`stop`. A loop (or a periodic body) that raises is logged with
  its name and traceback, counted in :attr:`restarts`, and started again after ``restart_s``
  (a periodic body: at its next tick). A bug in one pass therefore costs one pass, never the
  loop: before this, a NATS hiccup in the rollout service's metrics loop ended it for good,
  and with it the end-of-data notice the trainer waits for.
- A loop that returns on its own is done (not restarted).
- ``on_restart`` (optional) is called once per restart, e.g. to feed a metric.
- :attr:`stop_event` is the one event every loop watches; :meth:`sleep` waits on it.
- :meth:`stop` sets it and waits for the loops up to ``timeout_s``, then cancels what is left.

Not covered: restart limits or escalation (a loop that fails every pass logs every pass).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class LoopSupervisor:
    """See the module docstring. ``owner`` names the service in log lines."""

    def __init__(self, owner: str, *, restart_s: float = 1.0, on_restart: Callable[[str], None] | None = None) -> None:
        self.owner = owner
        self.restart_s = restart_s
        self.on_restart = on_restart
        self.stop_event = asyncio.Event()
        self.restarts: dict[str, int] = {}
        self._tasks: list[asyncio.Task] = []

    @property
    def stopping(self) -> bool:
        return self.stop_event.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stop; True when stopping."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), seconds)
        except TimeoutError:
            pass
        return self.stopping

    def _failed(self, name: str, delay_s: float) -> None:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        log.exception("background loop %r of %s died; restarting it in %.1f s", name, self.owner, delay_s)
        if self.on_restart is not None:
            self.on_restart(name)

    def spawn(self, name: str, loop: Callable[[asyncio.Event], Awaitable[None]]) -> asyncio.Task:
        """Run ``loop(stop_event)`` until it returns or stop; restarted after an exception."""
        async def supervised() -> None:
            while not self.stopping:
                try:
                    await loop(self.stop_event)
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - logged with its traceback; liveness first
                    self._failed(name, self.restart_s)
                    await self.sleep(self.restart_s)

        task = asyncio.create_task(supervised(), name=name)
        self._tasks.append(task)
        return task

    def every(self, name: str, interval_s: float, body: Callable[[], Awaitable[None]]) -> asyncio.Task:
        """Run ``body()`` at once and then every ``interval_s`` until stop; a pass that raises
        is logged and counted, and the next pass comes at the next tick."""
        async def periodic(stop: asyncio.Event) -> None:
            while not stop.is_set():
                try:
                    await body()
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - one pass lost, not the loop
                    self._failed(name, interval_s)
                if await self.sleep(interval_s):
                    return

        return self.spawn(name, periodic)

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every loop (module docstring)."""
        self.stop_event.set()
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
        for task in pending:
            log.warning("background loop %r of %s did not stop within %.0f s: cancelled", task.get_name(), self.owner, timeout_s)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
