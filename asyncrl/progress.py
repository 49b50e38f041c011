"""How much a service got done lately: deltas of its monotonic counters over a time window.

A service samples its counters (tokens decoded, trajectories published, syncs succeeded, ...)
every ``window_s / SAMPLES_PER_WINDOW`` seconds (:attr:`ProgressWindow.interval_s`);
:meth:`ProgressWindow.deltas` answers "how much did each counter grow in the last
``window_s`` seconds", and :meth:`ProgressWindow.idle_for` "how long since it last grew".
Those two numbers are what ``/admin/status`` and the sync agent's ``/status`` reason about
when they say a run is stuck (``rollout_service/api/run_health.py``, ``sync_agent/health.py``).

Contract and limits:

- counters are monotonic between restarts and start at 0: one missing from older samples
  (created on first use) grew from 0; one that goes down (a restart of the process
  whose number it is) restarts its delta from the lower value instead of going negative;
- memory is bounded: only the background sampler stores samples (a status read passes its
  values as ``current``), and samples older than the window (one kept as the window's base)
  are dropped: about ``SAMPLES_PER_WINDOW + 2`` samples;
- before a full window has passed, deltas cover the time since the first sample:
  :meth:`covered_s` says how much (a caller reports "starting" rather than "stalled" then);
- not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

SAMPLES_PER_WINDOW = 12


@dataclass
class ProgressWindow:
    window_s: float = 60.0
    clock: object = time.monotonic
    _samples: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)
    _last_growth: dict[str, float] = field(default_factory=dict)
    _first_at: float | None = None

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")

    @property
    def interval_s(self) -> float:
        """How often the owner should call :meth:`observe` in the background."""
        return self.window_s / SAMPLES_PER_WINDOW

    def observe(self, counters: Mapping[str, float], now: float | None = None) -> None:
        """Record the counters' current values."""
        now = self.clock() if now is None else now
        values = {k: float(v) for k, v in counters.items() if v is not None}
        if self._first_at is None:
            self._first_at = now
        prev = self._samples[-1][1] if self._samples else {}
        for name, v in values.items():
            if name not in self._last_growth or v > prev.get(name, v):
                self._last_growth[name] = now
        self._samples.append((now, values))
        cutoff = now - self.window_s
        while len(self._samples) > 2 and self._samples[1][0] <= cutoff:
            self._samples.popleft()

    def deltas(self, now: float | None = None, current: Mapping[str, float] | None = None) -> dict[str, float]:
        """Growth of each counter over the window (or since the first sample, if younger);
        ``current``: the counters' values now, counted as a last sample without storing it."""
        now = self.clock() if now is None else now
        samples = self._samples_since(self._base(now)) if self._samples else []
        if current is not None:
            samples.append((now, {k: float(v) for k, v in current.items() if v is not None}))
        if not samples:
            return {}
        out = {}
        for name in samples[-1][1]:
            growth, prev = 0.0, samples[0][1].get(name, 0.0)  # a counter that appears later started at 0
            for _, values in samples[1:]:
                cur = values.get(name)
                if cur is None:
                    continue
                growth += cur - prev if cur >= prev else cur  # went down: a restart, count from zero
                prev = cur
            out[name] = growth
        return out

    def idle_for(self, name: str, now: float | None = None, current: Mapping[str, float] | None = None) -> float | None:
        """Seconds since ``name`` last grew (since it was first seen, if never); None if never
        seen. ``current`` as in :meth:`deltas`: a value above the last sample means 0."""
        now = self.clock() if now is None else now
        if current is not None and current.get(name) is not None and self._samples:
            last = self._samples[-1][1].get(name)
            if last is not None and float(current[name]) > last:
                return 0.0
        at = self._last_growth.get(name)
        return None if at is None else now - at

    def covered_s(self, now: float | None = None) -> float:
        """How many seconds of history the deltas cover (at most ``window_s``)."""
        if self._first_at is None:
            return 0.0
        now = self.clock() if now is None else now
        return min(self.window_s, now - self._first_at)

    def _base(self, now: float) -> float:
        """The time of the newest sample at or before the window's start (else the oldest)."""
        cutoff = now - self.window_s
        base = self._samples[0][0]
        for t, _ in self._samples:
            if t <= cutoff:
                base = t
        return base

    def _samples_since(self, base: float):
        return [(t, v) for t, v in self._samples if t >= base]
