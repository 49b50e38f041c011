"""The weight-sync interface and the controller that runs syncs beside training.

:class:`WeightPublisher` is what the daemon needs from a sync: "make the engines serve these
weights as version ``v``". Two implementations, chosen by config in
:func:`trainer_daemon.sync.build_publisher`:

- :class:`~trainer_daemon.sync.direct.DirectEnginePublisher` (``sync.url`` unset): the trainer
  drives the engines itself (the shared engine-side sequence of
  :mod:`asyncrl.sync_control.engine_update`) and broadcasts.
- :class:`~trainer_daemon.sync.agent.SyncAgentPublisher` (``sync.url`` set): the trainer asks
  the sync agent and only broadcasts; the agent drives engines and rollout.

Contract of ``publish(version, weights)``: ``weights`` is a snapshot of one version (training
goes on meanwhile): Hugging Face names → rank 0's host tensors, or the buckets already packed on
the weight group's device (:class:`~trainer_daemon.sync.staging.StagedWeights`,
``sync.staging``), or a :class:`~trainer_daemon.sync.streaming.BucketStream` the training
thread fills while the publish sends it (``two_buckets``; :meth:`SyncController.start` closes
it when the publish ends); ``version`` is the new weight version.
It returns metrics on success, and raises :class:`~asyncrl.weight_sync.WeightSyncError` when
the engines did not get the whole set (they keep serving the previous version, or — partly
updated — are quarantined by the sync agent). Every network call and collective inside it has a timeout. It runs
on the trainer's I/O loop; one publish at a time.

:class:`SyncController` (rank 0, main thread) starts a publish in the background and records
the outcome: the trainer's weight version is the checkpoint's (0 fresh) plus one per publish
that succeeded; a failed publish is logged and counted, training continues, and the next
sync point tries again with the same version number. A publish still running at the next
sync point is waited for (bounded); if it is still running then, that sync point is skipped.
When the engines are ahead (a restart lost steps the engines had received, or the agent says
"stale"), :meth:`SyncController.adopt` moves the version past theirs (trainer_daemon.state.lineage).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from asyncrl.sync_control.errors import WeightSyncError
from trainer_daemon.io_loop import IoLoop
from trainer_daemon.state.lineage import Lineage

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.5
"""How often a bounded wait for a publish re-reads its cutoff."""
Cutoff = Callable[[], "float | None"]
"""A monotonic time after which a wait gives up (None: no cutoff yet), read while waiting."""


class StaleVersion(WeightSyncError):
    """The engines already serve ``engines_version`` >= the version published (the sync agent's
    409 "stale"): the trainer must move its version past it (SyncController.adopt)."""

    def __init__(self, message: str, engines_version: int) -> None:
        super().__init__(message)
        self.engines_version = engines_version


class WeightPublisher(ABC):
    """Makes the engines serve a full set of weights as one version (module docstring)."""

    name = "publisher"

    @abstractmethod
    async def publish(self, version: int, weights) -> dict[str, float]:
        """Push ``weights`` as ``version``; metrics on success, WeightSyncError on failure."""

    async def current_version(self) -> int | None:
        """The newest weight version the engines serve (or the sync agent has accepted), None
        when it cannot be asked. A restored trainer moves past it (trainer_daemon.state.lineage)."""
        return None

    async def push_wanted(self) -> bool:
        """True when engines wait for a full push of the trainer's weights to serve again (the
        sync agent quarantined them and has nothing to reload them from). An idle trainer then
        publishes without waiting for its next step: with every engine out, no data would come."""
        return False

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release groups and connections (idempotent)."""


def trainer_nccl_versions() -> tuple[str | None, str]:
    """This process's NCCL version (``"2.27.5"``; None without CUDA) and torch version, which
    the engines' must match for an NCCL weight group (asyncrl.sync_control.layout.check_nccl)."""
    nccl = None
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # noqa: BLE001 - a CUDA build without NCCL
            nccl = None
    return nccl, torch.__version__


OUTCOMES_KEPT = 64


class SyncController:
    """Runs publishes in the background on the I/O loop and tracks the trainer's weight version."""

    def __init__(self, publisher: WeightPublisher, io: IoLoop, version: int, lineage: Lineage | None = None) -> None:
        self.publisher = publisher
        self.io = io
        self.version = version
        """The last version a publish of this trainer completed: the authority for the *next*
        number (``version + 1``); which version the engines serve is the sync agent's record
        (docs/architecture.md, "The weight version")."""
        self.lineage = lineage if lineage is not None else Lineage()
        self.failures = 0
        self.successes = 0
        self.last_failed = False
        """The last publish that finished failed (the trainer then asks sooner whether engines wait for a push)."""
        self.last: dict[str, float] = {}
        self.fresh = False  # `last` holds an outcome nobody has reported yet
        self._future: concurrent.futures.Future | None = None
        self._target = version
        self._started = 0.0
        self._finished: float | None = None
        self._stage_timings: dict[str, float] = {}
        self.outcomes: dict[int, bool] = {}
        """Target version → whether that publish succeeded (the last ``OUTCOMES_KEPT``)."""

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def start(self, weights, version: int | None = None) -> int:
        """Start publishing ``weights`` as ``version`` (default: current + 1); returns that version.
        Call :meth:`wait` first if one may be in flight."""
        if self._future is not None:
            raise RuntimeError("a weight sync is already in flight")
        self._target = self.version + 1 if version is None else version
        # packed buckets: the capture's timings (a stream's are written while it is sent), read with the outcome
        self._stage_timings: dict[str, float] = getattr(weights, "timings", {})
        self._started = time.perf_counter()
        self._finished = None
        self._future = self.io.submit(self.publisher.publish(self._target, weights))

        def done(f: concurrent.futures.Future) -> None:
            self._finished = time.perf_counter()
            close = getattr(weights, "close", None)
            if close is not None:  # a bucket stream: its producer must not wait for a publish that ended
                failed = f.cancelled() or f.exception() is not None
                close("the publish failed" if failed else "the publish ended", discard=failed)

        self._future.add_done_callback(done)
        return self._target

    def adopt(self, engines_version: int | None) -> bool:
        """The engines serve ``engines_version``: when that is ahead of this trainer's version,
        jump past it (the trainer's current weights become ``engines_version + 1``, recorded in
        the lineage so lags count steps, not numbers). True when it jumped."""
        if engines_version is None or engines_version <= self.version:
            return False
        old = self.version
        self.version = self._target = self.lineage.jump(old, engines_version)
        log.warning("the engines serve weight version %d, ahead of this trainer's %d (steps lost with a restart): "
                    "its weights are now version %d", engines_version, old, self.version)
        return True

    def poll(self) -> bool:
        """Record the outcome if the publish finished; True when it did."""
        fut = self._future
        if fut is None or not fut.done():
            return False
        self._future = None
        elapsed = (self._finished or time.perf_counter()) - self._started  # when it finished, not when we looked
        try:
            metrics = fut.result()
        except Exception as exc:  # noqa: BLE001 - any failure is a failed sync, never a crash
            self.failures += 1
            self.last_failed = True
            log.error("weight sync to version %d failed after %.1f s (%s); training continues, next sync retries",
                      self._target, elapsed, exc)
            self._record(self._target, False)
            if isinstance(exc, StaleVersion):
                self.adopt(exc.engines_version)
            self.last = {"trainer/sync_failures": float(self.failures)}
            self.fresh = True
            return True
        self.successes += 1
        self.last_failed = False
        self.version = self._target
        self._record(self._target, True)
        self.last = dict(metrics) | dict(self._stage_timings) | {"timing_s/weight_sync": elapsed, "trainer/sync_failures": float(self.failures)}
        self.fresh = True
        log.info("weights version %d published in %.2f s", self.version, elapsed)
        return True

    def _record(self, target: int, ok: bool) -> None:
        self.outcomes[target] = ok
        while len(self.outcomes) > OUTCOMES_KEPT:
            del self.outcomes[next(iter(self.outcomes))]

    def published(self, target: int, timeout_s: float | None, cutoff: Cutoff | None = None) -> bool | None:
        """Whether the publish to ``target`` succeeded, waiting (bounded, see :meth:`wait`) while
        it is the one in flight; None when it is still running after that or unknown."""
        if self._future is not None and self._target == target:
            self.wait(timeout_s, cutoff)
        return self.outcomes.get(target)

    def wait(self, timeout_s: float | None, cutoff: Cutoff | None = None) -> bool:
        """Block until the in-flight publish (if any) finished and record it; False if it is
        still running after ``timeout_s``, or past ``cutoff()`` (a monotonic time or None, read
        every ``WAIT_SLICE_S``: a stop that comes during the wait shortens it). The publish is
        left running: cancelling a broadcast half-way would only break the group — the caller
        skips its sync point instead."""
        if self._future is None:
            return True
        started = time.monotonic()
        end = None if timeout_s is None else started + timeout_s
        while not self._future.done():
            limit = end
            if cutoff is not None and (c := cutoff()) is not None:
                limit = c if limit is None else min(limit, c)
            now = time.monotonic()
            if limit is not None and now >= limit:
                log.error("weight sync to version %d still running after %.1f s of waiting", self._target, now - started)
                return False
            slice_s = None if limit is None and cutoff is None else min(WAIT_SLICE_S, limit - now if limit is not None else WAIT_SLICE_S)
            try:
                self._future.result(slice_s)
            except concurrent.futures.TimeoutError:
                continue  # the slice ended (or the publish failed with a timeout: done, recorded by poll())
            except Exception:  # noqa: BLE001 - recorded by poll()
                break
        self.poll()
        return True
