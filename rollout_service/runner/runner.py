"""The agent runner: admits samples under the staleness quota, drives their agents, pauses
and resumes around weight syncs, and hands finished trajectories to the outbox.

Contract (pinned by tests/rollout):

- **Admission.** A new sample (one prompt → ``rollout.n`` agents, one group) starts only
  while the runner is not paused, the prompt stream has prompts, the staleness quota allows
  it (:mod:`.quota`), the outbox has room (backpressure while NATS is unreachable) and
  fewer than ``max_concurrent_samples`` trajectories are in flight.
- **Pause** ``partial``: close the gate, abort this service's requests on every engine,
  and return once no generate call is in flight; aborted agents keep their tokens and
  continue after resume. ``drain``: stop admitting and return once every in-flight
  trajectory has finished. ``hold`` (``sync.pause_policy`` retract / in_place, where the
  engines keep the requests): stop new generate calls and return at once; the calls in flight
  wait at their engine and go on after the sync with the new weights (per-token versions from
  the engine's spans). All are idempotent; ``partial`` and ``drain`` time out with an error
  while staying paused (the sync agent then resumes at the old version).
- **Resume** ``version``: the quota is reset (verl: in-flight + queued samples become the
  stale carry-over), the gate opens, admission restarts. Resuming at the current version is
  a no-op apart from reopening.
- **Pause** ``per_request`` (``sync.pause_policy = "per_request"``): close the gate, then
  decide per call in flight: keep it at its engine (which the sync agent then pauses in the
  survivor mode), abort it by its exact rid to resume after the sync, or cancel it because the
  trainer would drop it for staleness (:mod:`.per_request`). A sample whose every trajectory
  was cancelled gives its place in the staleness quota back.
- **Exactly once.** A finished trajectory is written to the outbox (fsynced) before its
  agent checkpoint is deleted; on restart, checkpointed agents whose trajectory is already
  in the outbox are dropped, the others resume from their last checkpoint (:mod:`.restore`);
  trajectory ids are deterministic (``<run>-s<sample index>-<i>``) so re-running a sample is
  deduplicated by ``Nats-Msg-Id``.
- **Read model.** Outside this package the runner's state is read through
  :meth:`Runner.snapshot` (:mod:`.snapshot`), never through its fields.

Validation runs beside training, scheduled by :class:`~.validation.ValidationSchedule`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from asyncrl.config import RunConfig
from asyncrl.loops import LoopSupervisor
from asyncrl.sync_control.request_policy import RequestRule
from asyncrl.wire.rollout_admin import PauseOutcome
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.loop import run_agent
from rollout_service.agent.state import AgentState, Phase
from rollout_service.runner.accounting import RunnerCounters, TokenAccounting, VersionClock
from rollout_service.runner.finish import to_trajectory
from rollout_service.runner.groups import GroupBook
from rollout_service.runner.inflight import InFlightCalls
from rollout_service.runner.pause_modes import (
    DrainPause,
    HoldPause,
    PartialPause,
    PauseMode,
    PauseParts,
    PerRequestPause,
)
from rollout_service.runner.quota import QueueDepth, StalenessQuota, StarvationWatch
from rollout_service.runner.restore import restore, runner_document
from rollout_service.runner.snapshot import PromptProgress, RunnerSnapshot, TokenCounts
from rollout_service.runner.validation import ValidationSchedule, Validator
from rollout_service.serving import ServingState

log = logging.getLogger(__name__)

ADMISSION_POLL_S = 0.5  # re-check admission at least this often (queue depth changes outside)
STORE_RETRY_S = 2.0  # retry checkpoint writes/deletes that failed while NATS was unreachable
LOOP_RESTART_S = 1.0  # pause before restarting a background loop that raised
SLOW_PAUSE_S = 1.0  # a pause longer than this is logged with where its time went


@dataclass(frozen=True)
class RunnerSettings:
    """The runner's share of the run config (``from_config``)."""

    run_id: str
    n: int
    """``rollout.n``: agents per sample (one group)."""
    max_concurrent_samples: int
    max_required_samples: int
    max_queue_size: int
    test_freq: int
    val_before_train: bool
    publish_unit: str
    """``rollout.publish_unit``: ``trajectory`` or ``group``."""
    samples_per_sync: int = 1
    """``derived.samples_per_sync``: samples the trainer consumes between two syncs."""
    required_samples: int = 1
    """``derived.required_samples``: samples one trainer step takes."""
    quota_starvation_s: float = 30.0
    """``rollout.quota_starvation_s`` (:class:`~rollout_service.runner.quota.StarvationWatch`)."""
    project_versions: bool = True
    """``sync.per_request.project_versions``: judge staleness at the version a call's trajectory
    is expected to be trained at, not only the sync's."""
    request_rule: RequestRule = RequestRule(max_lag=None)
    """The per-request rule (``sync.per_request``; :mod:`.per_request`): a ``per_request`` pause
    decides with it; it cancels for staleness only under that policy."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RunnerSettings:
        d, r = cfg.derived, cfg.rollout
        return cls(run_id=cfg.run.id, n=r.n, max_concurrent_samples=d.max_concurrent_samples,
                   max_required_samples=d.max_required_samples, max_queue_size=d.max_queue_size, test_freq=r.test_freq,
                   val_before_train=r.val_before_train, publish_unit=r.publish_unit,
                   request_rule=RequestRule.from_config(cfg), project_versions=cfg.sync.per_request.project_versions,
                   samples_per_sync=d.samples_per_sync, required_samples=d.required_samples,
                   quota_starvation_s=cfg.rollout.quota_starvation_s)


class Runner:
    """See the module docstring. Build with the collaborators, then ``await start()``."""

    def __init__(self, settings: RunnerSettings, *, deps: AgentDeps | None, stream, outbox, publisher,
                 agent_store, state_store, queue_probe: Callable[[], Awaitable[QueueDepth]], abort_engines: Callable[[str], Awaitable[None]],
                 rid_prefix: str, validator: Validator | None = None, serving: ServingState | None = None,
                 calls: InFlightCalls | None = None, tokens: TokenAccounting | None = None,
                 abort_rids: Callable[[set[str]], Awaitable[None]] | None = None) -> None:
        """``deps``: what its agents run with, built before it from the same ``serving`` (gate),
        ``calls`` (every generate call counted) and ``tokens`` (decoded and kept) it is given
        (``rollout_service/build.py``): nothing is built from the runner itself."""
        self.settings = settings
        self.n = settings.n
        self.max_concurrent = settings.max_concurrent_samples
        self.quota = StalenessQuota(settings.max_required_samples, settings.max_queue_size)
        self.starvation = StarvationWatch(settings.quota_starvation_s)
        self.stream, self.outbox, self.publisher = stream, outbox, publisher
        self.agent_store, self.state_store = agent_store, state_store
        self.queue_probe, self.abort_engines, self.rid_prefix = queue_probe, abort_engines, rid_prefix
        self.abort_rids = abort_rids
        """Exact-rid aborts (a per-request pause); None: by prefix, one rid at a time."""
        self.serving = serving or ServingState()
        """What the rollout serves now: this runner writes it (restore, pause, resume), the
        engine pool reads it (:mod:`rollout_service.serving`)."""
        self.last_pause: PauseOutcome | None = None
        """What the last ``per_request`` pause decided (:mod:`.per_request`)."""
        self.tokens = tokens or TokenAccounting()
        self.clock = VersionClock()
        self.counters = RunnerCounters()
        self.agents: dict[str, AgentState] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.book = GroupBook(settings.n)
        """The open samples (:mod:`.groups`)."""
        self.queued_trajectories = 0
        self.trainer_held = 0
        """Trajectories delivered to the trainer and not yet acked (``QueueDepth.held``)."""
        self._wake = asyncio.Event()
        self.calls = calls or InFlightCalls()
        self.calls.listen(on_busy=lambda: self.clock.set_idle(False), on_idle=self._wake.set,
                          own=lambda state: state is not None and self.agents.get(getattr(state, "id", None)) is state)
        """Generate calls in flight; the service routes every call through ``calls.routed(pool)``."""
        self.loops = LoopSupervisor("the runner", restart_s=LOOP_RESTART_S, on_restart=self._loop_restarted)
        """Admission and publishing (:mod:`asyncrl.loops`: a bug that kills one is logged and it
        starts again; both keep their state on the runner, so a restart loses nothing)."""
        self._stop = self.loops.stop_event
        self.deps = deps
        self.validation = ValidationSchedule(settings.test_freq, validator)
        parts = PauseParts(serving=self.serving, calls=self.calls, abort_engines=abort_engines, rid_prefix=rid_prefix,
                           running=lambda: len(self.tasks) - self.parked_trajectories, abort_rids=abort_rids)
        per_request = PerRequestPause(parts, settings.request_rule, version=lambda: self.version,
                                      cancellable=lambda state: state.id in self.agents, projection=self._projection,
                                      record=self._record_per_request)
        self.pause_modes: dict[str, PauseMode] = {m.name: m for m in (HoldPause(parts), PartialPause(parts),
                                                                       DrainPause(parts), per_request)}
        """The strategy of each pause mode (:mod:`.pause_modes`)."""

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Resume from the checkpoints (:mod:`.restore`), then start admitting and publishing."""
        restored = await restore(state_store=self.state_store, agent_store=self.agent_store, outbox=self.outbox,
                                 stream=self.stream, quota=self.quota)
        self.book.restore(restored.groups)
        self.counters.dropped_already_finished += restored.dropped
        for state in restored.agents:
            self.counters.restored_agents += 1
            self._launch(state)
        self.serving.restored(self.version)
        log.info("restored %d agents (%d already finished), version %d", len(restored.agents), restored.dropped, self.version)
        if self.settings.val_before_train and self.version == 0:
            self.validation.start(0)  # beside the first training rollouts, in the background
        self.loops.spawn("admission", lambda _stop: self._admission_loop())
        self.loops.spawn("publisher", self.publisher.run)

    def _loop_restarted(self, _name: str) -> None:
        self.counters.loop_restarts += 1

    async def stop(self) -> None:
        """Stop admitting and driving agents; their last checkpoints stay in the KV bucket."""
        self._stop.set()
        self._wake.set()
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), self.loops.stop(), self.validation.stop(), return_exceptions=True)
        await self.agent_store.flush_dirty()
        await self._save_state()

    @property
    def version(self) -> int:
        return self.quota.version

    @property
    def paused(self) -> bool:
        return self.serving.paused

    @property
    def gate(self):
        return self.serving.gate

    @property
    def active_trajectories(self) -> int:
        return len(self.tasks)

    @property
    def parked_trajectories(self) -> int:
        """Agents waiting for an external environment (they hold no engine capacity)."""
        return sum(1 for s in self.agents.values() if s.phase == Phase.AWAITING_ENV)

    @property
    def groups(self) -> dict[str, int]:
        """Open group id → members not finished yet (read it; :attr:`book` changes it)."""
        return self.book.left

    @property
    def in_flight_samples(self) -> int:
        return self.book.in_flight

    def queue_versions(self) -> int:
        """Versions the trainer needs to consume the whole samples already queued (stream and
        outbox): a trajectory finishing now is trained after them (:mod:`.per_request`). The
        finished members of groups still decoding are not ahead of it: the trainer takes a
        group once it is whole, so they wait as it does (counted for the service's own groups,
        of size ``rollout.n``; a session's group of another size is counted as whole)."""
        whole = max(0, self.queued_trajectories + len(self.outbox) - self.book.finished_members_waiting())
        return whole // self.n // max(1, self.settings.samples_per_sync)

    @property
    def queued_samples(self) -> int:
        return math.ceil((self.queued_trajectories + len(self.outbox)) / self.n)

    @property
    def trainer_starving(self) -> bool:
        """Nothing in flight or queued, the quota used up, and the trainer holds less than a
        step: unless a sync is on its way, it can train again only on new samples
        (:class:`~rollout_service.runner.quota.StarvationWatch`)."""
        return self.in_flight_samples == 0 and self.queued_samples == 0 and not self.paused and \
            self.quota.staleness_samples >= self.quota.max_required_samples and \
            self.trainer_held < self.settings.required_samples * self.n

    def _relieve_starvation(self) -> None:
        """Credit the quota with the samples the trainer is short of a step once it has starved
        for ``rollout.quota_starvation_s`` (:class:`StarvationWatch`)."""
        if not self.starvation.observe(self.trainer_starving, time.monotonic()):
            return
        short = self.settings.required_samples - self.trainer_held // self.n
        log.warning("the trainer has held less than a step (%d trajectories) for %.0f s with nothing in flight or queued "
                    "and the staleness quota used up: it dropped samples as too stale; crediting %d sample(s) to the quota",
                    self.trainer_held, self.starvation.grace_s, short)
        self.quota.credit(short)
        self.counters.quota_credits += short

    # -- admission ------------------------------------------------------------------------
    def admission_blocker(self, external: bool = False) -> str | None:
        """Why no new sample starts now (None: one may). ``external``: a session, which
        does not need the prompt stream or a concurrency slot."""
        if self._stop.is_set():
            return "stopping"
        if self.paused:
            return f"paused ({self.serving.pause_mode})"
        if external:
            if not self.outbox.has_room():
                return f"outbox full ({len(self.outbox)} trajectories waiting for NATS)"
            return self.quota.blocked_reason(self.queued_samples)
        if self.stream.exhausted:
            return "prompt stream exhausted"
        if not self.outbox.has_room():
            return f"outbox full ({len(self.outbox)} trajectories waiting for NATS)"
        busy = self.active_trajectories - self.parked_trajectories
        if busy and busy + self.n > self.max_concurrent:
            return f"max_concurrent_samples reached ({busy} in flight, {self.parked_trajectories} parked on environments)"
        return self.quota.blocked_reason(self.queued_samples)

    async def _admission_loop(self) -> None:
        last_flush = time.monotonic()
        while not self._stop.is_set():
            if self.agent_store.pending and time.monotonic() - last_flush > STORE_RETRY_S:
                last_flush = time.monotonic()
                await self.agent_store.flush_dirty()
            try:
                self.queued_trajectories, self.trainer_held = await self.queue_probe()
            except Exception as exc:  # noqa: BLE001 - NATS down: keep the last known depth
                log.debug("queue probe failed: %s", exc)
            self._relieve_starvation()
            while self.admission_blocker() is None:
                await self._admit_sample()
            self.clock.set_idle(self.calls.count == 0 and not self.tasks)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), ADMISSION_POLL_S)
            except TimeoutError:
                pass

    async def _admit_sample(self) -> None:
        index = self.stream.produced
        record = next(self.stream)
        self.quota.on_start()
        self.counters.samples_started += 1
        group_id = f"s{index:08d}"
        states = [
            AgentState(id=f"{self.settings.run_id}-{group_id}-{i}", run_id=self.settings.run_id, group_id=group_id, group_size=self.n,
                       group_index=i, prompt_id=record.prompt_id, data_source=record.data_source,
                       ground_truth=record.ground_truth, extra_info=dict(record.extra_info), messages=record.chat(),
                       created_at=time.time())
            for i in range(self.n)
        ]
        await asyncio.gather(*(self.agent_store.put(state) for state in states))  # n writes, one round trip
        await self._save_state()
        self.book.open(group_id, self.n)
        for state in states:
            self._launch(state)

    def _launch(self, state: AgentState) -> None:
        self.agents[state.id] = state
        self.tasks[state.id] = asyncio.create_task(self._drive(state), name=f"agent-{state.id}")

    async def _drive(self, state: AgentState) -> None:
        try:
            if state.phase != Phase.DONE:
                await run_agent(state, self.deps)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one broken episode must not stop the service
            log.exception("agent %s failed", state.id)
            state.phase, state.finish_reason, state.failure = Phase.DONE, "error", "agent_crash"
            state.reward_details["error"] = f"{type(exc).__name__}: {exc}"[:300]
        await self._finish(state)

    async def enqueue(self, traj) -> None:
        """Durably hand a finished trajectory to the outbox (held until its group completes
        when ``publish_unit`` is ``group``) and account for it in its group. Returns once the
        file is durable; the file work runs in worker threads, so group mates finishing
        together are written concurrently and each counts only after its own write."""
        if self.settings.publish_unit == "group":
            await self.outbox.hold_async(traj)
            if self.book.member_finished(traj.group_id):
                await self.outbox.release_group_async(traj.group_id)
        else:
            await self.outbox.put_ready_async(traj)
            self.book.member_finished(traj.group_id)
        self.book.forget(traj.group_id)
        self.publisher.notify()

    async def drop_member(self, group_id: str) -> None:
        """A session of ``group_id`` ended without a trajectory (expired, or closed as failed
        before any completion): its group expects one member less, so the group's place is
        given back once the others are done, and with ``publish_unit = "group"`` the members
        held for it are released instead of waiting for one that never comes."""
        if self.book.member_left(group_id):
            if self.settings.publish_unit == "group":
                await self.outbox.release_group_async(group_id)
            self.publisher.notify()

    def admit_external(self, group_id: str, group_size: int, recorded_members: int = 0) -> tuple[int, str] | None:
        """Admission of a session: ``(HTTP status, why)`` when refused, else None. A new group
        counts as one started sample (staleness quota). A session joining a group still open
        fills one of that sample's places, so it takes no quota, but it is refused (409) once
        ``group_size`` sessions joined the group, and (429) while the service is paused or
        stopping, as a new group is (issue 67 L4: joins once skipped all three).
        ``recorded_members``: the group's sessions on record, counted when this process has
        not admitted them itself (after a restart)."""
        if group_id in self.groups:
            if self._stop.is_set() or self.paused:
                return 429, "stopping" if self._stop.is_set() else f"paused ({self.serving.pause_mode})"
            if not self.book.join(group_id, group_size, recorded_members):
                return 409, f"all {group_size} sessions of this group (group_size) have joined it"
            return None
        blocker = self.admission_blocker(external=True)
        if blocker is not None:  # NATS not taking trajectories is an outage (503); the rest is backpressure (429)
            return 503 if blocker.startswith("outbox full") else 429, blocker
        self.quota.on_start()
        self.counters.samples_started += 1
        self.book.open(group_id, group_size, session=True)
        return None

    async def _finish(self, state: AgentState) -> None:
        traj = to_trajectory(state, self.version)
        await self.enqueue(traj)
        if self.deps.external is not None:
            self.deps.external.forget(state.id)
        await self.agent_store.delete(state.id)
        self.tasks.pop(state.id, None)
        self.agents.pop(state.id, None)
        c = self.counters
        c.trajectories_finished += 1
        if traj.failure:
            c.failures[traj.failure] = c.failures.get(traj.failure, 0) + 1
            if state.cancelled:
                self._on_cancelled(state)
            log.warning("trajectory %s: %s (%s); it will not be trained", traj.id, traj.failure,
                        str(traj.reward_details.get("error") or traj.reward_details.get("expired") or "")[:200])
        c.partial_trajectories += traj.is_partial
        c.finish_reasons[traj.finish_reason] = c.finish_reasons.get(traj.finish_reason, 0) + 1
        self._wake.set()

    def _on_cancelled(self, state: AgentState) -> None:
        """A trajectory cancelled for staleness (:mod:`.per_request`): once every member of its
        sample is, the sample never trains and its place in the staleness quota is given back."""
        self.counters.stale_cancelled_tokens += state.response_length
        if not self.book.cancelled(state.group_id, state.group_size):
            return
        self.quota.on_cancelled()
        self.counters.cancelled_samples += 1

    # -- pause / resume -------------------------------------------------------------------
    async def pause(self, mode: str, timeout_s: float, target_version: int | None = None) -> None:
        """See the module docstring. ``mode`` is ``partial``, ``drain``, ``hold`` or
        ``per_request`` (:mod:`.per_request`, judged for a sync to ``target_version``: the
        next version when None)."""
        strategy = self.pause_modes.get(mode)
        if strategy is None:
            raise ValueError(f"unknown pause mode {mode!r} (one of {sorted(self.pause_modes)})")
        self.serving.pausing(mode)
        started, calls_at_start = time.monotonic(), self.calls.count
        await strategy.settle(started + timeout_s, timeout_s, self.version + 1 if target_version is None else target_version)
        stopped = time.monotonic()
        self.clock.set_idle(True)
        await self.agent_store.flush_dirty()
        await self._save_state()
        took = time.monotonic() - started
        if took > SLOW_PAUSE_S:
            log.info("pause (%s) took %.1f s: %.1f s until no call was in flight (%d at the start), %.1f s saving state",
                     mode, took, stopped - started, calls_at_start, time.monotonic() - stopped)

    def _projection(self) -> tuple[float | None, int]:
        """What a per-request pause projects with: the seconds a version takes and the versions
        already queued ahead (``sync.per_request.project_versions``; off: neither)."""
        if not self.settings.project_versions:
            return None, 0
        return self.serving.seconds_per_version, self.queue_versions()

    def _record_per_request(self, done: PauseOutcome, target: int) -> None:
        c = self.counters
        c.per_request_pauses += 1
        for outcome in ("kept", "resumed", "cancelled", "missed"):
            c.per_request_calls[outcome] = c.per_request_calls.get(outcome, 0) + getattr(done, outcome)
        c.reprefill_tokens += done.reprefill_tokens
        c.last_per_request_pause_s = done.seconds
        self.last_pause = done
        log.info("per-request pause to version %d: %d kept, %d resumed, %d cancelled (%d aborts missed) in %.2f s",
                 target, done.kept, done.resumed, done.cancelled, done.missed, done.seconds)

    async def resume(self, version: int) -> None:
        if version != self.version:
            self.clock.new_version(version)
            try:  # the reset must count what is queued *now*: a stale reading can block admission until the next version
                self.queued_trajectories, self.trainer_held = await self.queue_probe()
            except Exception as exc:  # noqa: BLE001 - NATS down: the last reading is the best we have
                log.warning("queue depth unknown at resume (%s); using the last reading", exc)
        self.quota.on_version(version, self.in_flight_samples, self.queued_samples)
        self.serving.resumed(version)
        await self._save_state()
        self._wake.set()
        self.validation.on_version(version)

    async def _save_state(self) -> None:
        await self.state_store.save(runner_document(self.stream, self.quota))

    # -- read model -----------------------------------------------------------------------
    def snapshot(self) -> RunnerSnapshot:
        """The runner's state now, as a value (see :mod:`.snapshot`)."""
        queued = self.queued_samples
        partial = sum(1 for s in self.agents.values() if s.phase == Phase.GENERATING and s.segment > 0)
        return RunnerSnapshot(
            version=self.version, paused=self.paused, pause_mode=self.serving.pause_mode,
            paused_for_s=None if self.serving.paused_at is None else round(time.monotonic() - self.serving.paused_at, 3),
            admission_blocked=self.admission_blocker(), active=self.active_trajectories, parked=self.parked_trajectories,
            generating=self.calls.count, partial=partial, in_flight_samples=self.in_flight_samples, queued_samples=queued,
            queued_trajectories=self.queued_trajectories, max_concurrent_samples=self.max_concurrent,
            quota=self.quota.snapshot(queued), outbox=len(self.outbox), outbox_rejected=self.outbox.rejected_count(),
            prompts=PromptProgress(self.stream.produced, self.stream.total, self.stream.epoch),
            tokens=TokenCounts(self.tokens.decoded, self.tokens.kept, self.tokens.wasted),
            idle_ratio=self.clock.last_idle_ratio, idle_ratio_current=self.clock.current_idle_ratio(),
            publisher=dataclasses.replace(self.publisher.stats), counters=self.counters.copy(),
            validation_configured=self.validation.configured, last_validation=self.validation.last_result,
            last_pause=self.last_pause,
        )
