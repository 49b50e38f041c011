"""Admin routes (bearer ``security.admin_token``): pause, resume, status, engines, validation.

The messages are :mod:`asyncrl.wire.rollout_admin` (its docstring lists the routes); every
action is idempotent and answers with the service's new :class:`RolloutStatus`. The runner
is read through its snapshot and driven through its methods (``pause``, ``resume``).
``POST /admin/validate`` (runs the validation set now) answers with its metrics.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from asyncrl.config import secret
from asyncrl.http.errors import ApiError
from asyncrl.http.openapi import errors
from asyncrl.sync_control.pause_policy import plan_for
from asyncrl.wire.rollout_admin import (
    AddEngineRequest,
    PauseRequest,
    QuarantineRequest,
    ResumeRequest,
    RolloutStatus,
)
from rollout_service.api.auth import require_token
from rollout_service.api.status import service_status
from rollout_service.runner.runner import PauseTimeout


def build_admin_router(svc) -> APIRouter:
    token = secret(svc.cfg.security.admin_token)

    def admin(request: Request) -> None:
        require_token(request, token, "admin")

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    def default_mode() -> str:
        return plan_for(svc.cfg.sync, svc.cfg.async_training).rollout_mode

    @router.post("/pause", responses=errors(504))
    async def pause(body: PauseRequest | None = None) -> RolloutStatus:
        body = body or PauseRequest()
        mode = body.mode or default_mode()
        now = svc.runner.snapshot()
        if now.paused and now.pause_mode == mode and (mode == "hold" or not now.generating and (mode == "partial" or not now.active)):
            return service_status(svc)  # already paused this way: nothing to wait for
        try:
            await svc.runner.pause(mode, body.timeout_s or svc.cfg.rollout.pause_timeout_s)
        except PauseTimeout as exc:
            raise ApiError(504, f"pause did not complete: {exc}; the service stays paused",
                           service_status=service_status(svc).model_dump()) from None
        return service_status(svc)

    @router.post("/resume", responses=errors(409))
    async def resume(body: ResumeRequest) -> RolloutStatus:
        current = svc.runner.snapshot().version
        if body.version < current:
            raise ApiError(409, f"version {body.version} is older than the current version {current}", param="version")
        await svc.runner.resume(body.version)
        svc.pool.refresh_versions_soon()
        return service_status(svc)

    @router.post("/validate", responses=errors(409))
    async def validate():
        if not svc.runner.snapshot().validation_configured:
            raise ApiError(409, "no validation set: set data.val_files")
        return await svc.validate()

    @router.get("/status")
    async def status() -> RolloutStatus:
        return service_status(svc)

    @router.post("/engines", responses=errors(409))
    async def add_engine(body: AddEngineRequest) -> RolloutStatus:
        try:
            svc.pool.add(str(body.url), body.id)
        except ValueError as exc:
            raise ApiError(409, str(exc), param="id") from None
        await svc.pool.check_once()
        return service_status(svc)

    @router.delete("/engines/{engine_id}")
    async def remove_engine(engine_id: str) -> RolloutStatus:
        if engine_id in svc.pool.engines:
            await svc.pool.remove(engine_id)
        return service_status(svc)

    @router.post("/engines/{engine_id}/quarantine", responses=errors(404))
    async def quarantine(engine_id: str, body: QuarantineRequest | None = None) -> RolloutStatus:
        body = body or QuarantineRequest()
        _known(engine_id)
        svc.pool.set_quarantine(engine_id, True, body.reason)
        return service_status(svc)

    @router.delete("/engines/{engine_id}/quarantine", responses=errors(404))
    async def release(engine_id: str) -> RolloutStatus:
        _known(engine_id)
        if svc.pool.engines[engine_id].state == "quarantined":
            svc.pool.set_quarantine(engine_id, False)
            svc.pool.refresh_versions_soon([engine_id])
        return service_status(svc)

    def _known(engine_id: str) -> None:
        if engine_id not in svc.pool.engines:
            raise ApiError(404, f"no engine {engine_id!r}; known: {sorted(svc.pool.engines)}", param="engine_id")

    return router
