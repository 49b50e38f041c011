"""Counters of the runner: what it started and finished, decoded vs kept tokens, and the
rollouter's idle ratio per weight version (verl's names where verl has them).

``RunnerCounters``: samples started, trajectories finished (partial, by finish reason, by
infrastructure failure: ``Trajectory.failure``, never trained), agents restored or dropped
at start. Only grow.

``TokenAccounting``: every generate call reports how many tokens the engine decoded and how
many the agent kept; a pause with partial rollout must waste none (``wasted == 0``).

``VersionClock``: verl's ``rollouter/idle_ratio`` — the fraction of a version's wall time
during which the rollouter had no generation in flight and nothing to run (paused, quota
used up, or no prompts). It is closed and reported at each version change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace


@dataclass
class RunnerCounters:
    samples_started: int = 0
    trajectories_finished: int = 0
    partial_trajectories: int = 0
    restored_agents: int = 0
    dropped_already_finished: int = 0
    loop_restarts: int = 0
    """Background loops (admission, publisher) restarted after an unexpected exception."""
    finish_reasons: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    per_request_calls: dict[str, int] = field(default_factory=dict)
    """Calls per-request pauses kept, resumed, cancelled, or failed to abort (``missed``)."""
    per_request_pauses: int = 0
    reprefill_tokens: int = 0
    """Context tokens of the calls per-request pauses resumed (prefilled again)."""
    stale_cancelled_tokens: int = 0
    """Response tokens of trajectories cancelled for staleness (decoded, never trained)."""
    cancelled_samples: int = 0
    """Samples whose every trajectory was cancelled for staleness (their quota place given back)."""
    quota_credits: int = 0
    """Samples credited to the quota for a trainer that starved (``StarvationWatch``, issue 65)."""
    last_per_request_pause_s: float = 0.0
    """How long the last per-request pause took to decide and abort."""

    def copy(self) -> RunnerCounters:
        return replace(self, finish_reasons=dict(self.finish_reasons), failures=dict(self.failures),
                       per_request_calls=dict(self.per_request_calls))


@dataclass
class TokenAccounting:
    decoded: int = 0
    kept: int = 0

    def add(self, decoded: int, kept: int) -> None:
        self.decoded += decoded
        self.kept += kept

    @property
    def wasted(self) -> int:
        return self.decoded - self.kept


@dataclass
class VersionClock:
    version_started: float = field(default_factory=time.monotonic)
    idle_since: float | None = None
    idle_accum: float = 0.0
    last_idle_ratio: float | None = None
    last_version_time: float | None = None

    def set_idle(self, idle: bool) -> None:
        now = time.monotonic()
        if idle and self.idle_since is None:
            self.idle_since = now
        elif not idle and self.idle_since is not None:
            self.idle_accum += now - self.idle_since
            self.idle_since = None

    def current_idle_ratio(self) -> float:
        now = time.monotonic()
        idle = self.idle_accum + (now - self.idle_since if self.idle_since is not None else 0.0)
        total = now - self.version_started
        return idle / total if total > 0 else 0.0

    def new_version(self, version: int) -> None:
        """Close the current version's window (its ratio becomes ``last_idle_ratio``)."""
        self.last_idle_ratio = self.current_idle_ratio()
        self.last_version_time = time.monotonic() - self.version_started
        was_idle = self.idle_since is not None
        self.version_started = time.monotonic()
        self.idle_accum = 0.0
        self.idle_since = self.version_started if was_idle else None
