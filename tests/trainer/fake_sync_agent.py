"""A small sync agent for the trainer's tests: the protocol of ``asyncrl.wire.sync`` on a real
aiohttp server on 127.0.0.1, driving real engines with the product's own engine-side sequence
(:class:`asyncrl.sync_control.engine_update.EngineUpdate`), without the rollout service the real
agent pauses (the trainer's tests run none).

- ``POST /v1/syncs`` (bearer token) → ``202 SyncAccepted`` (400 on a body that is not a
  ``SyncRequest``, 401 without the token). Syncs run one after another in arrival order. A new
  group (``group.new`` or another address) is joined with the engines' layouts from
  ``/server_info``. ``ignore_next`` makes it accept a sync and fail it at once without touching
  the engines (the trainer's watcher must stop it); ``hold`` makes it accept every sync and
  leave it queued forever, its group a world of 2 whose engine never joins (a sync that never
  ends, as with an agent gone mid-sync; no engine needed).
- ``GET /v1/syncs/{id}`` → ``SyncStatus``.
- ``GET /status`` → ``{"version", "accepted_version", "push_wanted"}``: the last succeeded and
  the last accepted version, and ``push_wanted`` (set by a test; cleared by a sync that succeeds).

Runs its own event loop in a daemon thread so synchronous tests can use it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

from aiohttp import web
from pydantic import ValidationError

from asyncrl.engine_client import EngineClient
from asyncrl.launch import free_port
from asyncrl.sync_control.engine_update import EngineUpdate, Member
from asyncrl.wire.sync import DEFAULT_GROUP_NAME, SyncAccepted, SyncRequest, SyncStatus

ENGINE_CALL_TIMEOUT_S = 120.0


class FakeSyncAgent:
    def __init__(self, engine_urls: list[str], token: str) -> None:
        self.engine_urls = list(engine_urls)
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict] = []
        self.syncs: dict[str, SyncStatus] = {}
        self.ignore_next = 0
        self.hold = False
        self.push_wanted = False
        self.version = 0
        self.accepted_version = 0
        self._group: tuple | None = None
        self._offsets: list[int] = []
        self._world = 0
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> FakeSyncAgent:
        self._thread.start()
        assert self._started.wait(30), "fake sync agent did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._lock = asyncio.Lock()
        self._engines = [EngineClient(u, control_timeout_s=ENGINE_CALL_TIMEOUT_S) for u in self.engine_urls]
        app = web.Application()
        app.router.add_post("/v1/syncs", self._post)
        app.router.add_get("/v1/syncs/{id}", self._get)
        app.router.add_get("/status", self._status)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()
        for e in self._engines:
            await e.close()

    def _update(self, total_buckets: int = 0, group_name: str = DEFAULT_GROUP_NAME) -> EngineUpdate:
        members = [Member(e.base_url, e, rank_offset=self._offsets[i] if self._offsets else 1) for i, e in enumerate(self._engines)]
        return EngineUpdate(members, control_timeout_s=ENGINE_CALL_TIMEOUT_S, total_buckets=total_buckets, group_name=group_name)

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def _post(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        try:
            body = await request.json()
            sync = SyncRequest.model_validate(body)
        except (ValueError, ValidationError) as exc:
            return web.json_response({"error": f"bad body: {exc}"}, status=400)
        self.bodies.append(body)
        self.accepted_version = max(self.accepted_version, sync.version)
        sync_id = uuid.uuid4().hex
        join = sync.group.new or sync.group.key != self._group
        if join and self.hold:
            self._world = 2  # one engine rank that never joins: the trainer's group init waits for it
        elif join:
            update = self._update()
            _, world = await update.read_layouts()
            self._offsets, self._world = [m.rank_offset for m in update.members], world
        status = self.syncs[sync_id] = SyncStatus(id=sync_id, version=sync.version, state="queued")
        if self.ignore_next:
            self.ignore_next -= 1
            status.state, status.error = "failed", "ignored by the test"
        elif self.hold:
            pass
        else:
            asyncio.get_running_loop().create_task(self._run(status, sync, join))
        return web.json_response(SyncAccepted(id=sync_id, state=status.state, world_size=self._world, join_group=join).model_dump(),
                                 status=202)

    async def _status(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"version": self.version, "accepted_version": self.accepted_version,
                                  "push_wanted": self.push_wanted})

    async def _get(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        status = self.syncs.get(request.match_info["id"])
        return web.json_response(status.model_dump()) if status else web.json_response({"error": "unknown sync"}, status=404)

    async def _run(self, status: SyncStatus, sync: SyncRequest, join: bool) -> None:
        async with self._lock:
            update = self._update(len(sync.buckets), sync.group.group_name)
            status.state = "loading"
            try:
                await update.pause("abort")
                await update.begin()
                if join:
                    g = sync.group
                    await update.join(g.master_address, g.master_port, self._world, backend=g.backend, timeout_s=ENGINE_CALL_TIMEOUT_S)
                    self._group = g.key
                for i, bucket in enumerate(sync.buckets):
                    last = i == len(sync.buckets) - 1
                    await update.load(bucket, weight_version=sync.version if last else None, timeout_s=ENGINE_CALL_TIMEOUT_S,
                                      on_failure=lambda why: setattr(status, "state", "failing"))
                await update.end()
                await update.flush()
                status.state = "succeeded"
                self.version, self.push_wanted = sync.version, False
            except Exception as exc:  # noqa: BLE001 - reported through GET
                self._group = None
                status.state, status.error = "failed", f"{type(exc).__name__}: {exc}"
            finally:
                await update.release()
