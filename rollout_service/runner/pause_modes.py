"""How each pause mode settles the rollout before a weight sync: one small strategy per mode
behind one interface (issue 68 item 1), so a new policy is a new class, not another branch of
the runner.

Every strategy is entered with the gate state already marked *pausing*
(:meth:`~rollout_service.serving.ServingState.pausing`: no new sample is admitted) and returns
once the rollout is settled for its mode, or raises :class:`PauseTimeout` at ``deadline``
(``time.monotonic()``) with the rollout left paused:

- ``hold`` (``sync.pause_policy`` retract / in_place): close the gate and return at once; calls
  in flight wait at their engine and go on after the sync with the new weights.
- ``per_request``: close the gate, then keep, abort-and-resume or cancel each call in flight by
  its own facts (:mod:`.per_request`, wrapped unchanged); its outcome is recorded.
- ``partial``: close the gate and abort this service's calls until none is in flight: exact
  rids first (engines may be shared), then everything on an engine still holding one of ours.
- ``drain``: let the running trajectories finish (parked ones wait on their environment), then
  close the gate and let the session calls already at an engine finish.

Each strategy gets only what it uses (:class:`PauseParts`); none reaches into the runner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from asyncrl.sync_control.request_policy import RequestRule
from asyncrl.wire.rollout_admin import PauseOutcome
from rollout_service.runner.inflight import InFlightCalls
from rollout_service.runner.per_request import pause_per_request
from rollout_service.serving import ServingState

PAUSE_REABORT_S = 0.25  # re-send aborts while a pause waits: catches calls that raced the first abort
EXACT_ABORT_ROUNDS = 8  # then abort everything on the engines still holding our calls (~2 s into a pause)
DRAIN_POLL_S = 0.05


class PauseTimeout(RuntimeError):
    """The pause did not complete in time (the runner stays paused)."""


@dataclass(frozen=True)
class PauseParts:
    """What the strategies act on, given by the runner once."""

    serving: ServingState
    calls: InFlightCalls
    abort_engines: Callable[..., Awaitable[None]]
    """``abort_engines(prefix_or_rid, everything=False)``: abort on every engine."""
    rid_prefix: str
    running: Callable[[], int]
    """Trajectories running now, parked ones excluded (a drain waits for these)."""
    abort_rids: Callable[[set[str]], Awaitable[None]] | None = None
    """Exact-rid aborts; None: through ``abort_engines``, one rid at a time."""


class PauseMode(Protocol):
    name: str

    async def settle(self, deadline: float, timeout_s: float, target_version: int) -> None: ...


class _OnParts:
    """A strategy that needs only the shared parts."""

    def __init__(self, parts: PauseParts) -> None:
        self.parts = parts


class HoldPause(_OnParts):
    name = "hold"

    async def settle(self, deadline: float, timeout_s: float, target_version: int) -> None:
        self.parts.serving.hold_calls()


class PartialPause(_OnParts):
    name = "partial"

    async def settle(self, deadline: float, timeout_s: float, target_version: int) -> None:
        p = self.parts
        p.serving.hold_calls()
        rounds = 0
        while p.calls.count > 0:
            rounds += 1
            # exact rids first (engines may be shared); then every request of an engine that
            # still holds one of ours (an exact abort can be used up: pool.abort_inflight)
            await p.abort_engines(p.rid_prefix, everything=rounds > EXACT_ABORT_ROUNDS)
            if time.monotonic() > deadline:
                raise PauseTimeout(f"{p.calls.count} generate calls still in flight after {timeout_s:.0f} s")
            await asyncio.sleep(PAUSE_REABORT_S)


class DrainPause(_OnParts):
    name = "drain"

    async def settle(self, deadline: float, timeout_s: float, target_version: int) -> None:
        p = self.parts
        while (running := p.running()) > 0:  # in-flight agents keep generating; only admission stopped
            if time.monotonic() > deadline:
                raise PauseTimeout(f"{running} trajectories still running after {timeout_s:.0f} s")
            await asyncio.sleep(DRAIN_POLL_S)
        p.serving.hold_calls()
        while p.calls.count > 0:  # session requests already at the engine finish too
            if time.monotonic() > deadline:
                raise PauseTimeout(f"{p.calls.count} generate calls still in flight after {timeout_s:.0f} s")
            await asyncio.sleep(DRAIN_POLL_S)


class PerRequestPause:
    """The per-request rule (:mod:`.per_request`) as a pause mode; ``judge`` gives what it
    judges with at the moment of the pause, ``record`` takes its outcome."""

    name = "per_request"

    def __init__(self, parts: PauseParts, rule: RequestRule, *, version: Callable[[], int],
                 cancellable: Callable[[object], bool], projection: Callable[[], tuple[float | None, int]],
                 record: Callable[[PauseOutcome, int], None]) -> None:
        self.parts, self.rule = parts, rule
        self.version, self.cancellable, self.projection, self.record = version, cancellable, projection, record

    async def _abort(self, rids: set[str]) -> None:
        p = self.parts
        if p.abort_rids is not None:
            await p.abort_rids(rids)
        else:
            await asyncio.gather(*(p.abort_engines(rid) for rid in rids))

    async def settle(self, deadline: float, timeout_s: float, target_version: int) -> None:
        self.parts.serving.hold_calls()
        seconds_per_version, queue_versions = self.projection()
        done = await pause_per_request(self.parts.calls, self.rule, target_version, self.version(), self._abort,
                                       cancellable=self.cancellable, rounds=EXACT_ABORT_ROUNDS,
                                       interval_s=PAUSE_REABORT_S, seconds_per_version=seconds_per_version,
                                       queue_versions=queue_versions)
        self.record(done, target_version)
