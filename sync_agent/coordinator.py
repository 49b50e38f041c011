"""The transactional weight sync: pause → engines receive the broadcast → resume.

``SyncCoordinator.submit`` validates a request from the trainer, decides whether the
engines must (re)join a weight-update group, queues the sync and answers at once (202);
``run`` executes queued syncs one at a time (concurrent requests are serialised; an older
or equal version is refused with 409). One sync:

1. **pausing**: ``POST /admin/pause`` on the rollout service (``partial`` or ``drain`` from
   the config), then ``/pause_generation`` (abort) on every member engine;
2. **awaiting_broadcast**: when the group is new, every engine joins it
   (``/init_weights_update_group``, rank offset = 1 + the ranks of the engines before it);
   the calls return once the trainer has joined as rank 0;
3. **loading**: for each bucket, ``/update_weights_from_distributed`` on every engine (the
   calls return when the trainer's broadcast of that bucket is done); the new version is
   set with the last bucket, so an engine reports it only with every bucket loaded;
4. **resuming**: flush caches, then (in ``finally``, whatever happened) ``/continue_generation``
   on every paused engine and ``/admin/resume`` on the rollout service — at the new version
   when every member engine loaded it, else at the old one.

Whatever fails, nothing is left paused and no engine that may hold a mix of two versions
serves: a member that did not finish (or reports ``weights_consistent: false``) is
quarantined in the rollout service and marked for reload; the group is dropped (the next
sync forms a new one). :mod:`.reconcile` reloads and releases engines. Every phase has a
timeout; the state is persisted after every phase so a restarted agent reconciles
(:meth:`recover`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import torch

from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import EngineError
from asyncrl.weight_sync.buckets import parse_dtype
from sync_agent.records import GroupInfo, StateFile, SyncRecord
from sync_agent.rollout_admin import RolloutAdmin, RolloutAdminError

log = logging.getLogger(__name__)

RESUME_RETRIES = 5  # a resume that fails is retried: a rollout left paused stalls the whole run
RESUME_RETRY_S = 2.0


class SyncConflict(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def bucket_nbytes(bucket: dict[str, Any]) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=parse_dtype(dt)).element_size()
               for dt, shape in zip(bucket["dtypes"], bucket["shapes"]))


def version_of(raw: Any) -> int:
    try:
        return max(0, int(str(raw)))
    except (TypeError, ValueError):
        return 0


class SyncCoordinator:
    def __init__(self, cfg, state_file: StateFile, rollout: RolloutAdmin) -> None:
        self.cfg = cfg
        self.state_file = state_file
        self.rollout = rollout
        self.version, self.group, self.records = state_file.load()
        self.accepted_version = self.version
        self.queue: asyncio.Queue[SyncRecord] = asyncio.Queue()
        self.clients: dict[str, EngineClient] = {}
        self.needs_reload: set[str] = set()
        self.running: SyncRecord | None = None
        self.reload_hint: dict[str, Any] | None = None
        self.last_views: list[dict[str, Any]] = []
        self.unfinished: SyncRecord | None = next((r for r in reversed(self.records) if not r.done), None)
        """A sync the previous agent process left unfinished; new syncs wait until it is recovered."""
        at = cfg.async_training
        self.pause_mode = "partial" if at.partial_rollout and at.staleness_threshold > 0 else "drain"
        self.gpus = cfg.engines.gpus_per_engine

    # -- engines -------------------------------------------------------------------------
    def client(self, engine_id: str, url: str) -> EngineClient:
        c = self.clients.get(engine_id)
        if c is None or c.base_url != url.rstrip("/"):
            e = self.cfg.engines
            key = e.api_key.get_secret_value() if e.api_key else None
            admin = e.admin_api_key.get_secret_value() if e.admin_api_key else None
            c = self.clients[engine_id] = EngineClient(url, api_key=key, admin_api_key=admin, control_timeout_s=self.cfg.sync.engine_timeout_s)
        return c

    async def engine_views(self) -> list[dict[str, Any]]:
        """The rollout service's engines with each one's liveness, version and consistency."""
        engines = (await self.rollout.status())["engines"]

        async def view(e: dict) -> dict:
            out = {"id": e["id"], "url": e["url"], "rollout_state": e["state"], "reason": e.get("reason"), "alive": False,
                   "version": None, "consistent": None}
            try:
                info = await self.client(e["id"], e["url"]).model_info(timeout_s=self.cfg.sync.engine_timeout_s)
                out.update(alive=True, version=version_of(info.get("weight_version")), consistent=info.get("weights_consistent", True))
            except EngineError:
                pass
            return out

        views = list(await asyncio.gather(*(view(e) for e in engines)))
        self.last_views = views
        return views

    # -- accepting ------------------------------------------------------------------------
    async def submit(self, body: dict[str, Any]) -> tuple[SyncRecord, int]:
        version = int(body["version"])
        if self.unfinished is not None:
            raise SyncConflict(503, "recovering", f"still recovering sync {self.unfinished.id}, which the previous agent left "
                                                  "unfinished (waiting for the rollout service and the engines)")
        if version < self.version:
            raise SyncConflict(409, "stale", f"version {version} is older than the engines' version {self.version}")
        if version < self.accepted_version and self.running is not None:
            raise SyncConflict(409, "stale", f"a sync to version {self.accepted_version} is already under way")
        views = [v for v in await self.engine_views() if v["alive"]]
        if not views:
            raise SyncConflict(503, "no_engines", "no live engine to update")
        g = body["group"]
        live = {v["id"]: v["url"] for v in views}
        if self.group is not None and (g["master_address"], g["master_port"]) == self.group.key and not g.get("new"):
            if set(live) != set(self.group.members):
                self.group = None
                self.persist()
                raise SyncConflict(409, "regroup", "the engines changed since the group was formed; form a new group (new port)")
            join, members, world = False, self.group.members, self.group.world_size
        elif g.get("new") or self.group is None or (g["master_address"], g["master_port"]) != self.group.key:
            order = sorted(live)
            members = {eid: 1 + i * self.gpus for i, eid in enumerate(order)}
            join, world = True, 1 + self.gpus * len(order)
        if body.get("reload"):
            self.reload_hint = dict(body["reload"])
        rec = SyncRecord(version=version, group={**g, "world_size": world, "members": members, "urls": live},
                         buckets=body["buckets"], flattened=bool(body.get("flattened", True)), reload=body.get("reload"),
                         join_group=join)
        self.accepted_version = max(self.accepted_version, version)
        self.records.append(rec)
        self.persist()
        await self.queue.put(rec)
        return rec, world

    def persist(self) -> None:
        self.state_file.save(self.version, self.group, self.records)

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
        self.persist()
        log.info("sync %s (version %d): %s", rec.id, rec.version, phase)

    async def execute(self, rec: SyncRecord) -> None:
        s = self.cfg.sync
        rec.previous_version = self.version
        members: dict[str, int] = rec.group["members"]
        clients = {eid: self.client(eid, rec.group["urls"][eid]) for eid in members}
        done_buckets = {eid: 0 for eid in members}
        paused_rollout, paused_engines = False, []
        try:
            self._enter(rec, "pausing")
            await self.rollout.pause(self.pause_mode, s.pause_timeout_s)
            paused_rollout = True
            await _all({eid: c.pause("abort", timeout_s=s.engine_timeout_s) for eid, c in clients.items()}, s.engine_timeout_s, "pause")
            paused_engines = list(clients)
            self._enter(rec, "awaiting_broadcast")
            if rec.join_group:
                await self._form_group(rec, clients, members)
            self._enter(rec, "loading")
            g = rec.group
            for i, bucket in enumerate(rec.buckets):
                last = i == len(rec.buckets) - 1
                calls = {eid: c.update_weights_from_distributed(
                    bucket["names"], bucket["dtypes"], bucket["shapes"], group_name=g.get("group_name", "weight_update_group"),
                    weight_version=str(rec.version) if last else None, load_format="flattened_bucket" if rec.flattened else None,
                    flush_cache=False, timeout_s=s.broadcast_timeout_s) for eid, c in clients.items()}
                await _all(calls, s.broadcast_timeout_s + 10, f"bucket {i}", done=done_buckets)
                rec.bytes += bucket_nbytes(bucket)
            self._enter(rec, "resuming")
            await asyncio.gather(*(c.flush_cache(retries=3, interval_s=0.5, timeout_s=s.engine_timeout_s) for c in clients.values()),
                                 return_exceptions=True)
            self.version = rec.version
            rec.engines = {eid: "loaded" for eid in members}
            self.needs_reload -= set(members)  # a full push rewrote every parameter: consistent again
        except Exception as exc:  # noqa: BLE001 - every failure ends in the same safe state
            rec.error = f"{rec.state}: {type(exc).__name__}: {exc}"[:1000]
            log.error("sync %s failed in %s: %s", rec.id, rec.state, exc)
            await self._contain_failure(rec, clients, done_buckets)
        finally:
            await asyncio.gather(*(clients[eid].resume(timeout_s=s.engine_timeout_s) for eid in paused_engines), return_exceptions=True)
            if paused_rollout:
                await self._resume_rollout(rec)
            self._enter(rec, "succeeded" if rec.error is None else "failed")

    async def _form_group(self, rec: SyncRecord, clients: dict[str, EngineClient], members: dict[str, int]) -> None:
        s = self.cfg.sync
        g = rec.group
        name = g.get("group_name", "weight_update_group")
        # leave any old group of that name first (best effort: after a failure or a restart the
        # engines may still hold one the agent no longer tracks)
        await asyncio.gather(*(c.destroy_weights_update_group(name, timeout_s=s.engine_timeout_s) for c in clients.values()),
                             return_exceptions=True)
        self.group = None
        calls = {eid: c.init_weights_update_group(g["master_address"], g["master_port"], members[eid], g["world_size"], name,
                                                  g.get("backend", "gloo"), timeout_s=s.group_init_timeout_s)
                 for eid, c in clients.items()}
        await _all(calls, s.group_init_timeout_s + 10, "group join")
        self.group = GroupInfo(g["master_address"], g["master_port"], g.get("backend", "gloo"), name, g["world_size"], dict(members))
        self.persist()

    async def _contain_failure(self, rec: SyncRecord, clients: dict[str, EngineClient], done: dict[str, int]) -> None:
        """Quarantine every member that may hold mixed weights; drop the group."""
        total = len(rec.buckets)
        for eid, c in clients.items():
            try:
                info = await c.model_info(timeout_s=self.cfg.sync.engine_timeout_s)
                consistent = info.get("weights_consistent")
                mixed = consistent is False or (consistent is None and 0 < done[eid] < total)
                at_new = version_of(info.get("weight_version")) == rec.version and consistent is not False
            except EngineError:
                mixed, at_new = True, False
            rec.engines[eid] = "loaded" if at_new and done[eid] == total else ("mixed" if mixed else "unchanged")
            if mixed:
                self.needs_reload.add(eid)
                try:
                    await self.rollout.quarantine(eid, f"sync-agent: failed update to version {rec.version}")
                except RolloutAdminError as exc:
                    log.error("could not quarantine %s: %s", eid, exc)
        if self.group is not None:
            await asyncio.gather(*(c.destroy_weights_update_group(self.group.group_name, timeout_s=self.cfg.sync.engine_timeout_s)
                                   for c in clients.values()), return_exceptions=True)
        self.group = None
        if clients and all(v == "loaded" for v in rec.engines.values()):
            self.version = rec.version  # every engine made it: the failure came after the last bucket

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


async def _all(calls: dict[str, Any], timeout_s: float, what: str, done: dict[str, int] | None = None) -> None:
    """Await every engine's call; raise naming the engines that failed or timed out."""
    tasks = {eid: asyncio.ensure_future(c) for eid, c in calls.items()}
    finished, pending = await asyncio.wait(tasks.values(), timeout=timeout_s)
    for t in pending:
        t.cancel()
    errors = []
    for eid, t in tasks.items():
        if t in pending:
            errors.append(f"{eid}: no answer within {timeout_s:.0f} s")
        elif t.exception() is not None:
            errors.append(f"{eid}: {t.exception()}")
        elif done is not None:
            done[eid] += 1
    if errors:
        raise EngineError(f"{what} failed on " + "; ".join(errors))
