"""What the rollout serves now: one small state object, built first and given to the two that
share it (issue 50 item 2), instead of closures over a runner bound after the pool.

- The **runner** is its only writer, at three moments: after restoring its checkpoint
  (:meth:`ServingState.restored`), at a pause (:meth:`pausing`, with its mode and start, then
  :meth:`hold_calls` when its mode's strategy closes the gate:
  :mod:`rollout_service.runner.pause_modes`) and at a resume (:meth:`resumed`).
- The **engine pool** reads it: whether the rollout is paused for a sync (engines are paused on
  purpose: no health verdicts), whether the gate holds calls (a call waiting for a routable
  engine goes back to the gate), the version served (an engine back from quarantine at it is
  routable again) and the adapter every call asks for (adapter syncs).
- The **agents** wait on :attr:`gate` before every generate call.
- The per-request rule reads :attr:`ServingState.seconds_per_version` (how fast versions come,
  from the resumes) to project the version a call's trajectory will be trained at.

``version`` here is a cache of the run's weight version as the rollout serves it (the sync
agent's resume sets it; the authority is the sync agent's record, docs/architecture.md
"The weight version"). Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio
import time

from asyncrl.wire.sync import adapter_name

VERSION_PACE_WEIGHT = 0.3  # weight of the newest interval in seconds_per_version


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


class ServingState:
    """The rollout's serving state (module docstring). ``run_id`` and ``syncs_adapters`` decide
    the adapter route; a default instance serves the base model, version 0, unpaused."""

    def __init__(self, run_id: str = "", syncs_adapters: bool = False) -> None:
        self.run_id, self.syncs_adapters = run_id, syncs_adapters
        self.gate = Gate()
        self.version = 0
        self.paused = False
        self.pause_mode: str | None = None
        """The mode of the pause in progress (None while serving)."""
        self.paused_at: float | None = None
        """``time.monotonic()`` when the pause in progress began (None while serving)."""
        self.seconds_per_version: float | None = None
        """Wall time between two versions, averaged (None until two resumes to a new version):
        how fast the trainer moves, for projecting when a call's trajectory will be trained."""
        self._version_since: float | None = None

    @property
    def holding_calls(self) -> bool:
        """Whether the gate holds agents' calls (a ``partial`` or ``hold`` pause, or a ``drain``
        pause once its trajectories are done)."""
        return self.gate.paused

    @property
    def adapter_route(self) -> tuple[str, int] | None:
        """Adapter syncs: the adapter of the served version and that version, which every call
        asks for (``lora_path``); None for the base model (full-weight syncs, or version 0: a
        fresh adapter adds zero)."""
        if not self.syncs_adapters or not self.version:
            return None
        return adapter_name(self.run_id, self.version), self.version

    # -- the runner's writes -------------------------------------------------------------
    def restored(self, version: int) -> None:
        self.version = version

    def pausing(self, mode: str) -> None:
        """A pause in ``mode`` begins (or a repeated one goes on: its start is kept)."""
        self.paused = True
        self.pause_mode = mode
        if self.paused_at is None:
            self.paused_at = time.monotonic()

    def hold_calls(self) -> None:
        self.gate.close()

    def resumed(self, version: int) -> None:
        now = time.monotonic()
        if version > self.version:
            if self._version_since is not None:
                took = (now - self._version_since) / (version - self.version)
                self.seconds_per_version = took if self.seconds_per_version is None else \
                    (1 - VERSION_PACE_WEIGHT) * self.seconds_per_version + VERSION_PACE_WEIGHT * took
            self._version_since = now
        self.version = version
        self.paused = False
        self.pause_mode = self.paused_at = None
        self.gate.open()
