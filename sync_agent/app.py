"""The sync agent's HTTP API (bearer ``security.sync_token`` on every route but ``/health``
and ``/metrics``; the read-only ``security.status_token`` on the GET routes).

    POST /v1/syncs        asyncrl.wire.sync.SyncRequest → 202 SyncAccepted
                          409 {"error": {"reason": "stale" | "regroup" | "layout" | "nccl_mismatch", ...}}
                          (stale also carries "current_version": the version to move past);
                          503 (reason "no_engines" | "recovering") without engines or while an unfinished sync is recovered
    GET  /v1/syncs/{id}   → SyncStatus: state (queued, staging (adapter syncs), pausing, awaiting_broadcast, loading, failing,
                            resuming, succeeded, failed), phase_seconds, bytes, gb_per_s, engines, error
    GET  /v1/syncs        → the last syncs
    GET  /status          → current version, the group, every engine's version and state, the last syncs,
                            push_wanted (engines wait for the trainer's full weights, or a failed sync left the
                            rollout unable to start anything until a new version: an idle trainer publishes)
    GET  /health, GET /metrics
"""

from __future__ import annotations

import hmac
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from asyncrl.config import secret
from asyncrl.http.errors import ApiError, BodySizeLimit, install_error_handlers
from asyncrl.http.openapi import document_errors, errors
from asyncrl.wire.sync import AgentStatus, SyncAccepted, SyncRequest
from sync_agent.coordinator import SyncConflict
from sync_agent.health import agent_health
from sync_agent.metrics import SyncCollector
from sync_agent.rollout_admin import RolloutAdminError

MAX_BODY_BYTES = 64 * 2**20  # bucket metadata of a large model (names and shapes) fits easily


def create_app(agent) -> FastAPI:
    token = secret(agent.cfg.security.sync_token)
    status_token = secret(agent.cfg.security.status_token)

    def auth(request: Request) -> None:
        """The sync token opens every route; the read-only status token (``security.status_token``,
        for monitoring: it cannot start a sync, which can point engines at any address) opens
        the GET routes only."""
        if token is None:
            return
        header = request.headers.get("authorization", "")
        got = header[7:].strip() if header.lower().startswith("bearer ") else None
        if not got:
            raise ApiError(401, "the sync agent requires 'Authorization: Bearer <sync token>'", headers={"WWW-Authenticate": "Bearer"})
        if hmac.compare_digest(got.encode(), token.encode()):
            return
        if status_token and request.method == "GET" and hmac.compare_digest(got.encode(), status_token.encode()):
            return
        raise ApiError(403, "invalid sync token" if request.method != "GET" or not status_token else "invalid sync or status token")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await agent.start()
        try:
            yield
        finally:
            await agent.close()

    # its OpenAPI document only with the sync (or status) token, no browsable /docs (issue 67:
    # both were served to anyone who could reach the port)
    app = FastAPI(title="asyncrl sync agent", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(SyncCollector(agent))
    co = agent.coordinator
    router = APIRouter(dependencies=[Depends(auth)])

    @router.post("/v1/syncs", status_code=202, responses=errors(409, 503))
    async def submit(body: SyncRequest) -> SyncAccepted:
        try:
            rec, world = await co.submit(body)
        except SyncConflict as exc:
            co.refused(exc, body.version)
            raise ApiError(exc.status, exc.message, param=exc.code, reason=exc.code, **exc.extra) from None
        except RolloutAdminError as exc:
            raise ApiError(503, f"the rollout service is unreachable: {exc}") from None
        return SyncAccepted(id=rec.id, state=rec.state, world_size=world, join_group=rec.join_group)

    @router.get("/v1/syncs/{sync_id}", responses=errors(404))
    async def get_sync(sync_id: str):
        rec = co.find(sync_id)
        if rec is None:
            raise ApiError(404, f"no sync {sync_id!r}", param="sync_id")
        return rec.public()

    @router.get("/v1/syncs")
    async def list_syncs():
        return {"syncs": [r.public() for r in co.records[-20:]]}

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi_document():
        return JSONResponse(app.openapi())

    @router.get("/status")
    async def status() -> AgentStatus:
        unreachable = None
        try:
            engines = await co.engine_views()
            push = co.push_wanted(engines)
        except RolloutAdminError as exc:
            engines, push, unreachable = [], False, str(exc)
        health = agent_health(co, engines, push, agent.progress, time.time() - agent.started_at,
                              rollout_error=unreachable)
        return AgentStatus(version=co.version, accepted_version=co.accepted_version, pause_mode=co.pause_mode,
                           push_wanted=push, health=health,
                           group=None if co.group is None else {**co.group.__dict__},
                           running=co.running.id if co.running else None, queued=co.queue.qsize(),
                           needs_reload=sorted(co.needs_reload), engines=engines, rollout_error=unreachable,
                           syncs=[r.public() for r in co.records[-10:]])

    app.include_router(router)

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "version": co.version})

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    public = ("/health", "/metrics")
    document_errors(app, authenticated=lambda path: token is not None and path not in public)
    return app
