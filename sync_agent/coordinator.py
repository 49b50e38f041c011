"""The transactional weight sync: pause → engines receive the broadcast → resume.

``SyncCoordinator.submit`` validates a :class:`~asyncrl.wire.sync.SyncRequest`, decides
whether the engines must (re)join a weight-update group (reading each engine's layout from
``/server_info`` and refusing layouts or NCCL versions that cannot work), queues the sync and
answers at once (202); ``run`` executes queued syncs one at a time (an older or equal version
is refused with 409). The engine side of a sync is
:class:`~asyncrl.sync_control.engine_update.EngineUpdate`; around it:

1. **pausing**: ``POST /admin/pause`` on the rollout service, then ``/pause_generation`` and
   ``/begin_weight_update`` on every member engine (the modes from ``sync.pause_policy``:
   :mod:`asyncrl.sync_control.pause_policy`);
2. **awaiting_broadcast**: when the group is new, every engine joins it at its rank offset;
   the calls return once the trainer has joined as rank 0;
3. **loading**: each bucket's ``/update_weights_from_distributed`` on every engine while the
   trainer broadcasts it; the last bucket carries the new version. The first engine that
   refuses or fails a bucket turns the sync **failing** at once (the trainer watches and stops
   broadcasting);
4. **resuming**: ``/end_weight_update``, the weights check (``sync.check_weights``: engines whose
   ``/weights_checker`` checksum disagrees with the others' count as mixed), flush caches (as
   the policy allows), then (in ``finally``, whatever happened)
   ``/continue_generation`` on every paused engine and ``/admin/resume`` on the rollout service
   — at the new version when every member loaded it, else at the old one.

Whatever fails, nothing is left paused and no engine that may hold a mix of two versions
serves: a member that was sent a bucket and did not confirm every bucket is quarantined in
the rollout service (before it resumes) and marked for reload; the group is dropped (the next
sync forms a new one). Nothing relies on what an engine says about its own consistency:
SGLang says nothing. :mod:`.reconcile` reloads and releases engines. The state is persisted
after every phase so a restarted agent reconciles (:func:`.reconcile.recover`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from asyncrl.config.sections_engines import EnginesConfig
from asyncrl.config.sections_infra import ActorConfig, SyncConfig
from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import EngineError
from asyncrl.sync_control.adapter_load import stage_adapter, switch_adapter
from asyncrl.sync_control.engine_update import EngineUpdate, Member
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.sync_control.group_plan import GroupRefused, plan_group
from asyncrl.sync_control.layout import LayoutError
from asyncrl.sync_control.pause_policy import PausePlan, plan_for
from asyncrl.sync_control.sequence import UpdateSteps, run_update
from asyncrl.wire.sync import AdapterSpec, EngineView, ReloadSpec, SyncRequest
from sync_agent.fleet import AGENT_REASON, Fleet, held_because
from sync_agent.health import SyncTally
from sync_agent.history import SyncHistory
from sync_agent.records import (
    KEEP_RECORDS,
    AdapterRef,
    AgentState,
    GroupInfo,
    PlannedGroup,
    StateFile,
    SyncRecord,
)
from sync_agent.rollout_admin import RolloutAdmin, RolloutAdminError

log = logging.getLogger(__name__)

RESUME_RETRIES = 5  # a resume that fails is retried: a rollout left paused stalls the whole run
RESUME_RETRY_S = 2.0


class SyncConflict(Exception):
    """A refused submit: HTTP status, the reason (``asyncrl.wire.sync.REFUSALS``), a message."""

    def __init__(self, status: int, code: str, message: str, **extra) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra


@dataclass(frozen=True)
class CoordinatorSettings:
    """The coordinator's share of the run config (``from_config``): the ``sync``, ``engines``
    and ``actor`` sections, the run id, the pause plan and whether syncs carry adapters."""

    sync: SyncConfig
    engines: EnginesConfig
    actor: ActorConfig
    run_id: str
    plan: PausePlan
    syncs_adapters: bool

    @classmethod
    def from_config(cls, cfg) -> CoordinatorSettings:
        return cls(sync=cfg.sync, engines=cfg.engines, actor=cfg.actor, run_id=cfg.run.id,
                   plan=plan_for(cfg.sync, cfg.async_training), syncs_adapters=cfg.syncs_adapters)


class SyncCoordinator:
    def __init__(self, settings: CoordinatorSettings, state_file: StateFile, rollout: RolloutAdmin) -> None:
        self.settings = settings
        self.state_file = state_file
        self.rollout = rollout
        self.history = SyncHistory(state_file.path.parent, settings.sync.history_max_bytes)
        state = state_file.load()
        self.version, self.group, self.records, self.needs_reload = state.version, state.group, state.records, state.needs_reload
        self.accepted_version = self.version
        """``version``: what the engines serve after the last successful sync, the run's authority
        on it (older syncs are refused); ``accepted_version``: the newest one queued or running.
        The rollout's ``ServingState`` and the engines' labels are caches of it
        (docs/architecture.md, "The weight version")."""
        self.queue: asyncio.Queue[SyncRecord] = asyncio.Queue()
        self.fleet = Fleet(settings.engines, settings.sync.engine_timeout_s, rollout)
        """The engines as the agent sees them: clients, liveness, views (:mod:`.fleet`)."""
        self.liveness = self.fleet.liveness
        self.running: SyncRecord | None = None
        self.reload_hint: ReloadSpec | None = None
        self.unfinished: SyncRecord | None = next((r for r in reversed(self.records) if not r.done), None)
        """A sync the previous agent process left unfinished; new syncs wait until it is recovered."""
        self.plan = settings.plan
        self.pause_mode = self.plan.rollout_mode
        self.tally = SyncTally()
        """Outcomes since this process started (the records are bounded; these counts are not)."""
        self.adapters: dict[str, AdapterSpec] = {}
        """The adapter (tensors included) of each queued or running adapter sync, by sync id;
        memory only, dropped when the sync ends."""

    # -- engines (the fleet view: sync_agent/fleet.py) -------------------------------------
    def client(self, engine_id: str, url: str) -> EngineClient:
        return self.fleet.client(engine_id, url)

    async def engine_views(self) -> list[EngineView]:
        """The rollout service's engines with each one's liveness, served version, whether it
        awaits a reload (it may hold mixed weights) and why it is held (:mod:`.fleet`)."""
        views = await self.fleet.views(self.needs_reload)
        source = self.reload_source()
        for v in views:
            v.held_because = held_because(v, version=self.version, needs_reload=self.needs_reload, reload_source=source)
        self.fleet.last_views = views
        return views

    def reload_source(self) -> tuple[str, int] | None:
        """Where engines that may hold mixed weights reload from: the trainer's newest export named
        in a sync request, else ``sync.reload_path`` (version 0), else None (a full push)."""
        if self.reload_hint is not None:
            return self.reload_hint.path, self.reload_hint.version
        if self.settings.sync.reload_path:
            return self.settings.sync.reload_path, 0
        return None

    def push_wanted(self, views: list[EngineView]) -> bool:
        """Live engines wait for the trainer's full weights to serve again: marked for reload with
        nothing to reload from, or quarantined here while serving another version. The trainer,
        idle because no data comes, then publishes at once (``WeightPublisher.push_wanted``)."""
        if self.running is not None or self.unfinished is not None or not self.queue.empty():
            return False
        no_source = self.reload_source() is None
        return self.starved_after_a_failed_sync() or any(
            v.alive and ((v.id in self.needs_reload and no_source)
                         or (v.rollout_state == "quarantined" and (v.reason or "").startswith(AGENT_REASON)
                             and v.version != self.version))
            for v in views)

    def starved_after_a_failed_sync(self) -> bool:
        """The last sync failed, so the engines and the rollout stay at the old version, and the
        rollout can start nothing until a new one comes (its staleness quota used up, nothing in
        flight): the trainer, waiting for data that cannot come, must push again. Found by a
        rollout service killed inside a sync's pause (tests/loop/test_finite_run_faults.py)."""
        last = self.records[-1] if self.records else None
        status = self.fleet.last_rollout
        if last is None or last.state != "failed" or last.version <= self.version or status is None:
            return False
        blocked = status.admission_blocked or ""
        return blocked.startswith("staleness quota used") and status.counts.active == 0

    def _update(self, rec: SyncRecord) -> EngineUpdate:
        g = rec.group
        if g is None:  # an adapter sync: no group, one load per member
            members = [Member(eid, self.client(eid, url)) for eid, url in rec.urls.items()]
            return EngineUpdate(members, control_timeout_s=self.settings.sync.engine_timeout_s, total_buckets=1)
        members = [Member(eid, self.client(eid, g.urls[eid]), rank_offset=offset) for eid, offset in g.members.items()]
        return EngineUpdate(members, control_timeout_s=self.settings.sync.engine_timeout_s, total_buckets=len(rec.buckets),
                            group_name=g.group_name)

    async def _plan_group(self, request: SyncRequest, live: dict[str, str]) -> tuple[dict[str, int], int]:
        """Rank offsets and world size of a new group of the ``live`` engines (id → url), from
        their layouts; SyncConflict for a layout or NCCL versions that cannot work."""
        order = sorted(live)
        update = EngineUpdate([Member(eid, self.client(eid, live[eid])) for eid in order],
                              control_timeout_s=self.settings.sync.engine_timeout_s)
        try:
            _, world = await plan_group(update, self.plan, [n for bucket in request.buckets for n in bucket.names],
                                        backend=request.group.backend,
                                        nccl_versions=(request.group.nccl_version, request.group.torch_version))
        except GroupRefused as exc:
            raise SyncConflict(409, exc.code, exc.message) from None
        except LayoutError as exc:
            raise SyncConflict(409, "layout", str(exc)) from None
        except EngineError as exc:
            raise SyncConflict(503, "no_engines", f"reading an engine's /server_info failed: {exc}") from None
        return {m.id: m.rank_offset for m in update.members}, world

    async def problems_at_start(self) -> list[str]:
        """Why this run cannot sync on its configured engines, judged when the agent starts
        (:meth:`sync_agent.fleet.Fleet.problems_at_start`)."""
        return await self.fleet.problems_at_start(self.plan, self.settings.actor if self.settings.syncs_adapters else None)

    # -- accepting ------------------------------------------------------------------------
    async def submit(self, request: SyncRequest) -> tuple[SyncRecord, int]:
        version = request.version
        if self.unfinished is not None:
            raise SyncConflict(503, "recovering", f"still recovering sync {self.unfinished.id}, which the previous agent left "
                                                  "unfinished (waiting for the rollout service and the engines)")
        if version < self.version:
            raise SyncConflict(409, "stale", f"version {version} is older than the engines' version {self.version}",
                               current_version=self.version)
        if version < self.accepted_version and self.running is not None:
            raise SyncConflict(409, "stale", f"a sync to version {self.accepted_version} is already under way",
                               current_version=self.accepted_version)
        views = [v for v in await self.engine_views() if v.alive]
        if not views:
            raise SyncConflict(503, "no_engines", "no live engine to update")
        if request.adapter is not None:
            return await self._queue(SyncRecord(
                version=version, group=None, buckets=[], urls={v.id: v.url for v in views},
                adapter=AdapterRef(name=request.adapter.name, path=request.adapter.path, nbytes=request.adapter.nbytes)),
                request), 1
        g = request.group
        live = {v.id: v.url for v in views}
        if self.group is not None and g.key == self.group.key and not g.new:
            if set(live) != set(self.group.members):
                self.group = None
                self.persist()
                raise SyncConflict(409, "regroup", "the engines changed since the group was formed; form a new group (new port)")
            join, members, world = False, self.group.members, self.group.world_size
        else:
            members, world = await self._plan_group(request, live)
            join = True
        if request.reload is not None:
            self.reload_hint = request.reload
        planned = PlannedGroup(**{**g.model_dump(), "world_size": world, "members": dict(members), "urls": live})
        rec = SyncRecord(version=version, group=planned, buckets=list(request.buckets), reload=request.reload, join_group=join)
        return await self._queue(rec, request), world

    async def _queue(self, rec: SyncRecord, request: SyncRequest) -> SyncRecord:
        self.accepted_version = max(self.accepted_version, rec.version)
        if request.adapter is not None:
            self.adapters[rec.id] = request.adapter
        self.records.append(rec)
        del self.records[:-KEEP_RECORDS]  # bounded: the state file keeps as many
        self.persist()
        await self.queue.put(rec)
        return rec

    def persist(self) -> None:
        self.state_file.save(AgentState(self.version, self.group, self.records, self.needs_reload))

    def find(self, sync_id: str) -> SyncRecord | None:
        return next((r for r in self.records if r.id == sync_id), None)

    # -- running --------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                rec = await asyncio.wait_for(self.queue.get(), 0.5)
            except TimeoutError:
                continue
            self.running = rec
            try:
                await self.execute(rec)
            finally:
                self.running = None

    def _enter(self, rec: SyncRecord, phase: str) -> None:
        rec.enter(phase)
        if rec.done:
            self.tally.finished(rec.state, rec.error, rec.bytes)
            self.history.append("finished", **rec.public())
        self.persist()
        log.info("sync %s (version %d): %s", rec.id, rec.version, phase)

    def refused(self, exc: SyncConflict, version: int) -> None:
        """A sync request answered with an error (counted, and kept in the history)."""
        self.tally.refuse(exc.code, exc.message)
        self.history.append("refused", code=exc.code, message=exc.message, version=version)

    def _failing(self, rec: SyncRecord, why: str) -> None:
        """Published at once: the trainer's watcher stops broadcasting when it sees it."""
        if rec.error is None:
            rec.error = f"{rec.state}: {why}"[:1000]
            log.error("sync %s failed in %s: %s", rec.id, rec.state, why)
        if rec.state != "failing":
            self._enter(rec, "failing")

    async def execute(self, rec: SyncRecord) -> None:
        s = self.settings.sync
        rec.previous_version = self.version
        update = self._update(rec)
        paused_rollout = contained = False

        staged: set[str] = set()

        async def load() -> None:
            if rec.adapter is not None:
                await switch_adapter(update, staged, rec.adapter.name, rec.version, timeout_s=s.engine_timeout_s)
                rec.bytes += rec.adapter.nbytes
                return
            for i, spec in enumerate(rec.buckets):
                last = i == len(rec.buckets) - 1
                await update.load(spec, weight_version=rec.version if last else None, timeout_s=s.broadcast_timeout_s,
                                  on_failure=lambda why: self._failing(rec, why))
                rec.bytes += spec.nbytes

        left_out: list = []  # members that could not stage the adapter: nothing more is asked of them

        def take_back_left_out() -> None:
            update.members.extend(left_out)  # their outcome (unchanged) is recorded and they are held out
            left_out.clear()

        async def contain(exc: BaseException) -> None:
            nonlocal contained
            contained = True
            take_back_left_out()
            self._failing(rec, f"{type(exc).__name__}: {exc}")
            await self._contain_failure(rec, update)

        try:
            if rec.adapter is not None:  # loaded beside the current one before anything pauses (adapter_load)
                self._enter(rec, "staging")
                staged |= await stage_adapter(update, self.adapters[rec.id], run_id=self.settings.run_id, keep=self.version,
                                              transport=s.adapter_transport, timeout_s=s.engine_timeout_s,
                                              shared_dir=s.adapter_dir is not None)
                if not staged:
                    raise WeightSyncError(f"no engine staged adapter {rec.adapter.name}: "
                                          + "; ".join(f"{m.id}: {m.error}" for m in update.members))
                # one that failed (refused it, or died on it as SGLang's server does on a bad payload) keeps
                # its previous adapter: pausing it too would fail the sync for everyone when it is gone
                left_out[:] = [m for m in update.members if m.id not in staged]
                update.members[:] = [m for m in update.members if m.id in staged]
            self._enter(rec, "pausing")
            paused = await self.rollout.pause(self.pause_mode, s.pause_timeout_s, rec.version)
            if self.pause_mode == "per_request":
                rec.pause_outcome = paused.last_pause
            paused_rollout = True
            steps = UpdateSteps(load=load, form=(lambda: self._form_group(rec, update)) if rec.join_group else None,
                                phase=lambda phase: self._enter(rec, phase), contain=contain,
                                session=rec.adapter is None)  # an adapter sync opens no weight session (issue 46)
            await run_update(update, self.plan.engine_mode, self.plan.flush_retries, steps,
                             check_weights=s.check_weights and rec.adapter is None)  # an adapter leaves the base as it was
            take_back_left_out()
            self.version = rec.version
            rec.engines = {m.id: update.outcome(m) for m in update.members}  # "mixed": outvoted by the weights check
            if rec.adapter is None:  # a full push rewrote every parameter (an adapter leaves the base alone)
                self.needs_reload -= {eid for eid, o in rec.engines.items() if o == "loaded"}
            await self._quarantine_mixed(rec)
            if rec.adapter is not None:
                await self._quarantine_unloaded(rec, update)
        except Exception as exc:  # noqa: BLE001 - every failure ends in the same safe state
            if not contained:  # the rollout's pause failed (or nothing staged): nothing was sent to an engine
                take_back_left_out()
                self._failing(rec, f"{type(exc).__name__}: {exc}")
                await self._contain_failure(rec, update)
        finally:
            if rec.error is None:
                await self._release_loaded(rec)
            if paused_rollout:
                await self._resume_rollout(rec)
            self.adapters.pop(rec.id, None)
            self._enter(rec, "succeeded" if rec.error is None else "failed")

    async def _release_loaded(self, rec: SyncRecord) -> None:
        """Members this sync wrote whole (every parameter, the current version) that the agent
        had quarantined serve again now, before the rollout resumes, not a reconcile round
        later: a quarantined member keeps no requests, so waiting only idles it (issue 33).
        Quarantines set by others (an operator, the rollout's health checks) are left alone; a
        release that fails is retried by the reconcile loop."""
        try:
            for e in (await self.rollout.status()).engines:
                eid = e.id
                ours = (e.reason or "").startswith(AGENT_REASON)
                if e.state == "quarantined" and ours and rec.engines.get(eid) == "loaded" and eid not in self.needs_reload:
                    await self.rollout.release(eid)
                    log.info("engine %s released: sync %s wrote it whole at version %d", eid, rec.id, rec.version)
        except RolloutAdminError as exc:
            log.warning("releasing the engines sync %s loaded: %s (the reconcile loop retries)", rec.id, exc)

    async def _form_group(self, rec: SyncRecord, update: EngineUpdate) -> None:
        g = rec.group
        old, self.group = self.group, None
        if old is not None and old.group_name != g.group_name:
            await update.leave_group(old.group_name)  # trainers name every new group anew: free the old one
        await update.join(g.master_address, g.master_port, g.world_size, backend=g.backend,
                          timeout_s=self.settings.sync.group_init_timeout_s)
        self.group = GroupInfo(g.master_address, g.master_port, g.backend, g.group_name, g.world_size, dict(g.members))
        self.persist()

    async def _contain_failure(self, rec: SyncRecord, update: EngineUpdate) -> None:
        """Quarantine every member that may hold mixed weights (before the rollout resumes);
        drop the group."""
        rec.engines = {m.id: update.outcome(m) for m in update.members}
        self.liveness.mark_silent({m.id for m in update.members if m.stuck})  # hung or gone: not waited for next time
        await self._quarantine_mixed(rec)
        if rec.group is not None:  # an adapter sync formed no group and leaves the weight group alone
            await update.leave_group()
            self.group = None
        if all(o == "loaded" for o in rec.engines.values()):
            self.version = rec.version  # every engine made it: the failure came after the last bucket
        self.persist()

    async def _quarantine_mixed(self, rec: SyncRecord) -> None:
        """Quarantine (before the rollout resumes) and mark for reload every member whose
        outcome in ``rec.engines`` is ``mixed``."""
        for eid, outcome in rec.engines.items():
            if outcome != "mixed":
                continue
            self.needs_reload.add(eid)
            try:
                await self.rollout.quarantine(eid, f"{AGENT_REASON} failed update to version {rec.version}")
            except RolloutAdminError as exc:
                log.error("could not quarantine %s: %s", eid, exc)

    async def _quarantine_unloaded(self, rec: SyncRecord, update: EngineUpdate) -> None:
        """After an adapter sync that some members loaded: hold out (before the rollout resumes
        and asks for the new adapter by name) every member that did not; it serves the previous
        adapter whole, so it needs no reload, only a later sync that loads it."""
        for m in update.members:
            if rec.engines.get(m.id) == "loaded":
                continue
            try:
                await self.rollout.quarantine(m.id, f"{AGENT_REASON} did not load the adapter of version {rec.version}: {m.error}"[:500])
            except RolloutAdminError as exc:
                log.error("could not quarantine %s: %s", m.id, exc)

    async def _resume_rollout(self, rec: SyncRecord) -> None:
        for attempt in range(RESUME_RETRIES):
            try:
                await self.rollout.resume(self.version)
                rec.resumed_at_version = self.version
                return
            except RolloutAdminError as exc:
                log.error("resume of the rollout failed (%d/%d): %s", attempt + 1, RESUME_RETRIES, exc)
                await asyncio.sleep(RESUME_RETRY_S)
        rec.error = (rec.error or "") + "; the rollout service could not be resumed"
