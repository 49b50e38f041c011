"""The staleness quota: how many new samples the rollout may start, with verl's semantics.

verl's FullyAsyncRollouter keeps a counter ``staleness_samples``:

- it grows by one each time a **new** sample (a prompt, with its ``rollout.n``
  trajectories) is started; resuming a partial sample after a sync does not count again;
- at every weight-version update it is **reset** to the number of samples that will be
  stale under the new version: those in flight (active or paused partial) plus those
  finished but not yet taken by the trainer (undelivered in the stream; what the trainer holds
  for the step it assembles is trained without new samples and is not counted);
- the rollout admits a new sample only while ``staleness_samples < max_required_samples``
  (``(1 + staleness_threshold) * trigger_parameter_sync_step * require_batches *
  ppo_mini_batch_size``) and the queue holds fewer than ``max_queue_size`` samples.

So between two syncs the service starts at most ``max_required_samples`` minus the stale
samples it carried over — verl's ``rollout_num``. ``StalenessQuota`` is a plain object
(no I/O, no locks: the runner calls it from one event loop) so the invariant can be
property-tested on the counters alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple


class QueueDepth(NamedTuple):
    """The trainer's side of the queue, read from its consumer (``rollout_service.build.queue_depth``)."""

    undelivered: int
    """Trajectories in the stream not yet delivered to the trainer (verl's message queue)."""
    held: int
    """Delivered and not yet acked: what the trainer holds for the step it assembles or trains."""


@dataclass
class QuotaSnapshot:
    """What ``/admin/status`` shows of the quota."""

    version: int
    max_required_samples: int
    max_queue_size: int
    staleness_samples: int
    started_this_version: int
    carried_over_at_reset: int
    remaining: int
    blocked_reason: str | None


@dataclass
class StalenessQuota:
    max_required_samples: int
    max_queue_size: int
    version: int = 0
    staleness_samples: int = 0
    started_this_version: int = 0
    carried_over_at_reset: int = 0
    history: list[tuple[int, int, int]] = field(default_factory=list)
    """(version, carried over at reset, started during the version), newest last, bounded."""

    HISTORY_LIMIT = 64

    def __post_init__(self) -> None:
        if self.max_required_samples < 1 or self.max_queue_size < 1:
            raise ValueError("max_required_samples and max_queue_size must be >= 1")

    def blocked_reason(self, queued_samples: int) -> str | None:
        """Why no new sample may start now, or None when one may."""
        if queued_samples >= self.max_queue_size:
            return f"queue full: {queued_samples} unconsumed samples >= max_queue_size {self.max_queue_size}"
        if self.staleness_samples >= self.max_required_samples:
            return (f"staleness quota used: staleness_samples {self.staleness_samples} >= "
                    f"max_required_samples {self.max_required_samples}")
        return None

    def can_start(self, queued_samples: int) -> bool:
        return self.blocked_reason(queued_samples) is None

    def on_start(self) -> None:
        """A new sample was admitted (call only after ``can_start`` said yes)."""
        self.staleness_samples += 1
        self.started_this_version += 1

    def credit(self, samples: int) -> None:
        """``samples`` started samples will never be trained (the trainer dropped them as too
        stale: :class:`StarvationWatch`): they no longer count against the quota."""
        self.staleness_samples = max(0, self.staleness_samples - samples)

    def on_cancelled(self) -> None:
        """A started sample was cancelled whole for staleness (never trained): it no longer
        counts against the quota (``rollout_service.runner.per_request``)."""
        self.staleness_samples = max(0, self.staleness_samples - 1)

    def on_version(self, version: int, in_flight_samples: int, queued_samples: int) -> None:
        """Weights changed to ``version``: reset the counter to what is now stale.

        A version never goes backwards; repeating the current version is a no-op, which
        makes ``/admin/resume`` idempotent.
        """
        if version < self.version:
            raise ValueError(f"weight version went backwards: {self.version} -> {version}")
        if version == self.version:
            return
        self.history.append((self.version, self.carried_over_at_reset, self.started_this_version))
        del self.history[: -self.HISTORY_LIMIT]
        self.version = version
        self.staleness_samples = in_flight_samples + queued_samples
        self.carried_over_at_reset = self.staleness_samples
        self.started_this_version = 0

    def snapshot(self, queued_samples: int) -> QuotaSnapshot:
        return QuotaSnapshot(
            version=self.version,
            max_required_samples=self.max_required_samples,
            max_queue_size=self.max_queue_size,
            staleness_samples=self.staleness_samples,
            started_this_version=self.started_this_version,
            carried_over_at_reset=self.carried_over_at_reset,
            remaining=max(0, self.max_required_samples - self.staleness_samples),
            blocked_reason=self.blocked_reason(queued_samples),
        )

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "history"}

    def load_state_dict(self, state: dict) -> None:
        for key in ("version", "staleness_samples", "started_this_version", "carried_over_at_reset"):
            setattr(self, key, int(state[key]))


@dataclass
class StarvationWatch:
    """The one way out of a quota no version will reset (issue 65).

    The quota resets at each weight version. A trainer that drops whole groups as too stale (a
    trainer restarted behind the rollout finds groups generated on its lost steps' weights) trains
    nothing with them, so it may hold less than a step with nothing in flight or undelivered and
    the quota used up: no version comes before new samples, no sample starts before a version.
    The same state lasts a moment in every run between the trainer's last commit of a version and
    the sync's pause (with ``staleness_threshold = 0`` always), so it is acted on only when it has
    lasted ``grace_s`` (far longer than a sync's pause takes to arrive): the samples the trainer is
    short of a step are credited to the quota (:meth:`StalenessQuota.credit`), generated at its
    current version. ``observe`` is called at each admission pass with the state and the clock."""

    grace_s: float
    since: float | None = None

    def observe(self, starving: bool, now: float) -> bool:
        """True once ``starving`` has held for ``grace_s`` (then the watch starts again)."""
        if not starving:
            self.since = None
            return False
        if self.since is None:
            self.since = now
            return False
        if now - self.since < self.grace_s:
            return False
        self.since = None
        return True
