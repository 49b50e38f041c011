"""Generate calls in flight through the runner — what a partial pause waits on.

Every generate call of the service (internal agents, OpenAI requests, streamed or not) goes
through :meth:`InFlightCalls.routed`'s generator, which counts it while it is at an engine.
A partial pause closes the gate, aborts the service's requests and returns once the count
is zero; the version clock treats the runner as busy while it is above zero.

Not covered: requests sent to an engine by anything else (the sync agent, other services).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any


class InFlightCalls:
    """Built before the runner and the agents' dependencies (both use it); the runner listens
    (:meth:`listen`) when it is built."""

    def __init__(self) -> None:
        self.count = 0
        self._on_busy: Callable[[], None] = lambda: None
        self._on_idle: Callable[[], None] = lambda: None

    def listen(self, on_busy: Callable[[], None], on_idle: Callable[[], None]) -> None:
        """``on_busy`` runs when a call starts, ``on_idle`` when the count falls back to zero."""
        self._on_busy, self._on_idle = on_busy, on_idle

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Count one call for the duration of the block."""
        self.count += 1
        self._on_busy()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._on_idle()

    def routed(self, engines) -> _Counted:
        """A :class:`~rollout_service.agent.deps.Generator` over ``engines`` (the pool) that
        counts its calls here."""
        return _Counted(engines, self)


class _Counted:
    def __init__(self, engines, calls: InFlightCalls) -> None:
        self.engines, self.calls = engines, calls

    async def generate(self, state, input_ids: list[int], sampling_params: dict, rid: str, extra: dict | None = None) -> Any:
        with self.calls.tracking():
            return await self.engines.generate(state, input_ids, sampling_params, rid, extra)

    async def generate_stream(self, state, input_ids: list[int], sampling_params: dict, rid: str,
                              extra: dict | None = None) -> AsyncIterator[Any]:
        with self.calls.tracking():
            async with contextlib.aclosing(self.engines.generate_stream(state, input_ids, sampling_params, rid, extra)) as results:
                async for res in results:
                    yield res
