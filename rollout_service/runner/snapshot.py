"""The read model of the runner: one typed value, taken at one moment.

``Runner.snapshot()`` returns a :class:`RunnerSnapshot`; ``/admin/status``, the Prometheus
collector, verl's metrics document, ``/health`` and the admin routes read it instead of the
runner's fields. It is a value: frozen, and its nested parts are copies, so it does not
change when the runner does (take a new one to see the new state). Every number in it is
computed once (``queued_samples`` feeds both the counts and the quota's blocked reason), so
one snapshot is self-consistent.

Cost: O(agents in flight) plus a listing of the outbox's ``rejected`` directory; cheap
enough for every status call and metrics scrape. Not covered: engines, tools and sessions,
which are not the runner's (the service reads those from their own objects).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_service.publish.publisher import PublisherStats
from rollout_service.runner.accounting import RunnerCounters
from rollout_service.runner.quota import QuotaSnapshot


@dataclass(frozen=True)
class PromptProgress:
    produced: int
    total: int
    epoch: int


@dataclass(frozen=True)
class TokenCounts:
    """Tokens the engines decoded for this service and tokens kept in trajectories."""

    decoded: int
    kept: int
    wasted: int


@dataclass(frozen=True)
class RunnerSnapshot:
    version: int
    """The weight version the runner is at (the quota's version)."""
    paused: bool
    pause_mode: str | None
    """``partial`` or ``drain`` while paused, else None."""
    paused_for_s: float | None
    """Seconds since the current pause began (None while running)."""
    admission_blocked: str | None
    """Why no new sample starts now (None: one may)."""
    active: int
    """Trajectories in flight (agent tasks, parked ones included)."""
    parked: int
    """Agents waiting for an external environment."""
    generating: int
    """Generate calls in flight (internal agents and OpenAI requests)."""
    partial: int
    """Agents holding a partial assistant turn (aborted by a pause, to be continued)."""
    in_flight_samples: int
    queued_samples: int
    """Finished samples not yet consumed by the trainer (stream + outbox)."""
    queued_trajectories: int
    max_concurrent_samples: int
    quota: QuotaSnapshot
    outbox: int
    outbox_rejected: int
    prompts: PromptProgress
    tokens: TokenCounts
    idle_ratio: float | None
    """verl's ``rollouter/idle_ratio`` of the last completed version (None before the first)."""
    idle_ratio_current: float
    publisher: PublisherStats
    counters: RunnerCounters
    validation_configured: bool
    last_validation: dict[str, Any] | None
    last_pause: Any = None
    """The last ``per_request`` pause's decisions (``asyncrl.wire.rollout_admin.PauseOutcome``; None: none)."""
