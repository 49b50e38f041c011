"""Admin routes (bearer ``security.admin_token``): pause, resume, status, engines, validation.

The messages are :mod:`asyncrl.wire.rollout_admin` (its docstring lists the routes); every
action is idempotent and answers with the service's new :class:`RolloutStatus`. The routes
use only their :class:`~rollout_service.api.ports.AdminPorts`: the runner read through its
snapshot and driven through ``pause`` / ``resume``, the engine pool, the status.
``POST /admin/validate`` (runs the validation set now) answers with its metrics.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request

from asyncrl.http.errors import ApiError
from asyncrl.http.openapi import errors
from asyncrl.wire.rollout_admin import (
    AddEngineRequest,
    PauseRequest,
    QuarantineRequest,
    ResumeRequest,
    RolloutStatus,
)
from rollout_service.api.auth import require_token
from rollout_service.api.ports import AdminPorts
from rollout_service.runner.pause_modes import PauseTimeout

log = logging.getLogger(__name__)


def build_admin_router(ports: AdminPorts) -> APIRouter:
    token, runner, pool, service_status = ports.admin_token, ports.runner, ports.engines, ports.status

    def admin(request: Request) -> None:
        require_token(request, token, "admin")

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    @router.post("/pause", responses=errors(504))
    async def pause(body: PauseRequest | None = None) -> RolloutStatus:
        body = body or PauseRequest()
        mode = body.mode or ports.pause_mode
        now = runner.snapshot()
        if now.paused and now.pause_mode == mode and (mode in ("hold", "per_request")
                                                      or not now.generating and (mode == "partial" or not now.active)):
            return service_status()  # already paused this way: nothing to wait for (a per-request pause decided once)
        try:
            await runner.pause(mode, body.timeout_s or ports.pause_timeout_s, body.version)
        except PauseTimeout as exc:
            raise ApiError(504, f"pause did not complete: {exc}; the service stays paused",
                           service_status=service_status().model_dump()) from None
        return service_status()

    @router.post("/resume", responses=errors(409))
    async def resume(body: ResumeRequest) -> RolloutStatus:
        current = runner.snapshot().version
        if body.version < current:
            raise ApiError(409, f"version {body.version} is older than the current version {current}", param="version")
        if body.version > current:  # only to a version a completed sync installed (issue 67: 2^63-1 wedged every later sync)
            served, answers = await pool.serves(body.version)
            if served is False:
                shown = sorted({v for v in answers if v is not None})
                raise ApiError(409, f"no engine serves version {body.version} (they answer {shown or 'no version'}): "
                                    "resume only to a version a completed sync installed", param="version")
            if served is None:  # every engine out of reach: never left paused for it
                log.warning("resuming to version %d with no engine answering its version", body.version)
        await runner.resume(body.version)
        pool.refresh_versions_soon()
        return service_status()

    @router.post("/validate", responses=errors(409))
    async def validate():
        if not runner.snapshot().validation_configured:
            raise ApiError(409, "no validation set: set data.val_files")
        return await ports.validate()

    @router.get("/status")
    async def status() -> RolloutStatus:
        return service_status()

    @router.post("/engines", responses=errors(403, 409))
    async def add_engine(body: AddEngineRequest) -> RolloutStatus:
        refusal = ports.engine_refusal(str(body.url))
        if refusal:  # the engine key would go there (issue 48)
            raise ApiError(403, refusal, param="url")
        why = await pool.unreachable(str(body.url))
        if why is not None:  # a typo or an engine not started yet: registered, it would only wait in the pool
            raise ApiError(409, f"the engine at {str(body.url).rstrip('/')} is {why}: not registered; start it first "
                                f"(its healthcheck healthy), then add it again", param="url")
        try:
            pool.add(str(body.url), body.id)
        except ValueError as exc:
            raise ApiError(409, str(exc), param="id") from None
        await pool.check_once()
        return service_status()

    @router.delete("/engines/{engine_id}")
    async def remove_engine(engine_id: str) -> RolloutStatus:
        if engine_id in pool.engines:
            await pool.remove(engine_id)
        return service_status()

    @router.post("/engines/{engine_id}/quarantine", responses=errors(404))
    async def quarantine(engine_id: str, body: QuarantineRequest | None = None) -> RolloutStatus:
        body = body or QuarantineRequest()
        _known(engine_id)
        pool.set_quarantine(engine_id, True, body.reason)
        return service_status()

    @router.delete("/engines/{engine_id}/quarantine", responses=errors(404))
    async def release(engine_id: str) -> RolloutStatus:
        _known(engine_id)
        if pool.engines[engine_id].state == "quarantined":
            pool.set_quarantine(engine_id, False)
            pool.refresh_versions_soon([engine_id])
        return service_status()

    def _known(engine_id: str) -> None:
        if engine_id not in pool.engines:
            raise ApiError(404, f"no engine {engine_id!r}; known: {sorted(pool.engines)}", param="engine_id")

    return router
