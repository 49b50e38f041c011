"""A small sync agent for tests: a real aiohttp server on 127.0.0.1 implementing the trainer's
side of the sync protocol (``trainer_daemon/sync/agent.py``) against real engines through
:class:`~asyncrl.engine_client.EngineClient`. The real agent lands with issue 6.

Routes (bearer token required):

- ``POST /v1/syncs`` → ``202 {"id", "join_group"}`` (400 on a malformed body, 401 without the
  token). Syncs run one after another in arrival order (a sync posted while the previous one
  still resumes the engines waits). In the background: pause engines (abort) → flush → if the body's group is new,
  destroy the old one and have every engine join it (rank ``1 + i``) → one
  ``/update_weights_from_distributed`` per bucket (``flattened_bucket``, ``weight_version`` on
  the last) → continue. ``ignore_next`` makes it accept a sync and do nothing (engines never
  join: the trainer's side must time out).
- ``GET /v1/syncs/{id}`` → ``{"id", "state": running|succeeded|failed, "version", "error"}``.

Runs its own event loop in a daemon thread so synchronous tests can use it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

from aiohttp import web

from asyncrl.engine_client import EngineClient
from asyncrl.launch import free_port

ENGINE_CALL_TIMEOUT_S = 120.0


class FakeSyncAgent:
    def __init__(self, engine_urls: list[str], token: str) -> None:
        self.engine_urls = list(engine_urls)
        self.token = token
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict] = []
        self.syncs: dict[str, dict] = {}
        self.ignore_next = 0
        self._group: tuple | None = None
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
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._started.set()
        await self._stop.wait()
        await runner.cleanup()
        for e in self._engines:
            await e.close()

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    async def _post(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        try:
            body = await request.json()
            version = int(body["version"])
            group = body["group"]
            key = (group["master_address"], int(group["master_port"]), group["backend"])
            buckets = [(list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]) for b in body["buckets"]]
            assert body.get("flattened") is True and buckets
        except Exception as exc:  # noqa: BLE001 - any malformed body is a 400
            return web.json_response({"error": f"bad body: {exc}"}, status=400)
        self.bodies.append(body)
        sync_id = uuid.uuid4().hex
        self.syncs[sync_id] = {"id": sync_id, "state": "running", "version": version, "error": None}
        if self.ignore_next:
            self.ignore_next -= 1
            self.syncs[sync_id].update(state="failed", error="ignored by the test")
        else:
            asyncio.get_running_loop().create_task(self._run(sync_id, version, key, group.get("world_size"), buckets))
        join = bool(group.get("new")) or key != self._group
        return web.json_response({"id": sync_id, "join_group": join}, status=202)

    async def _get(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        sync = self.syncs.get(request.match_info["id"])
        return web.json_response(sync) if sync else web.json_response({"error": "unknown sync"}, status=404)

    async def _run(self, sync_id: str, version: int, key: tuple, world_size: int | None, buckets) -> None:
        async with self._lock:
            await self._run_one(sync_id, version, key, world_size, buckets)

    async def _run_one(self, sync_id: str, version: int, key: tuple, world_size: int | None, buckets) -> None:
        engines = self._engines
        try:
            await asyncio.gather(*(e.pause("abort") for e in engines))
            await asyncio.gather(*(e.flush_cache(retries=30, interval_s=0.2) for e in engines))
            if key != self._group:  # a new group (the trainer also says so with "new": true)
                if self._group is not None:
                    await asyncio.gather(*(e.destroy_weights_update_group() for e in engines), return_exceptions=True)
                world = world_size or 1 + len(engines)
                await asyncio.gather(*(e.init_weights_update_group(key[0], key[1], 1 + i, world, backend=key[2])
                                       for i, e in enumerate(engines)))
                self._group = key
            for i, (names, dtypes, shapes) in enumerate(buckets):
                last = i == len(buckets) - 1
                await asyncio.gather(*(e.update_weights_from_distributed(
                    names, dtypes, shapes, load_format="flattened_bucket", flush_cache=False,
                    weight_version=str(version) if last else None) for e in engines))
            self.syncs[sync_id]["state"] = "succeeded"
        except Exception as exc:  # noqa: BLE001 - reported through GET
            self._group = None
            self.syncs[sync_id].update(state="failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            await asyncio.gather(*(e.resume() for e in engines), return_exceptions=True)
