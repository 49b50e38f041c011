"""Admin routes (bearer ``security.admin_token``): pause, resume, status, engines.

Every action is idempotent and answers with the service's new status as JSON. The runner
is read through its snapshot and driven through its methods (``pause``, ``resume``).

    POST   /admin/pause        {"mode": "partial" | "drain" | "hold" | null, "timeout_s": float | null}
    POST   /admin/resume       {"version": int}
    GET    /admin/status
    POST   /admin/validate     (runs the validation set now; answers with its metrics)
    POST   /admin/engines      {"url": "http://host:port", "id": str | null}
    DELETE /admin/engines/{id}
    POST   /admin/engines/{id}/quarantine   {"reason": str}
    DELETE /admin/engines/{id}/quarantine
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, HttpUrl

from asyncrl.config import secret
from asyncrl.http.errors import ApiError
from asyncrl.http.openapi import errors
from asyncrl.sync_control.pause_policy import plan_for
from rollout_service.api.auth import require_token
from rollout_service.api.status import service_status
from rollout_service.runner.runner import PauseTimeout


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PauseRequest(_Body):
    mode: Literal["partial", "drain", "hold"] | None = None
    """None: the mode of the run's pause plan (``asyncrl.sync_control.pause_policy``): ``partial``
    or ``hold`` when ``async_training.partial_rollout_active`` (by ``sync.pause_policy``), else ``drain``."""
    timeout_s: float | None = Field(None, gt=0, le=3600)


class ResumeRequest(_Body):
    version: int = Field(ge=0)


class AddEngineRequest(_Body):
    url: HttpUrl
    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")


class QuarantineRequest(_Body):
    reason: str = Field("quarantined by an operator", max_length=500)


def build_admin_router(svc) -> APIRouter:
    token = secret(svc.cfg.security.admin_token)

    def admin(request: Request) -> None:
        require_token(request, token, "admin")

    router = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    def default_mode() -> str:
        return plan_for(svc.cfg).rollout_mode

    @router.post("/pause", responses=errors(504))
    async def pause(body: PauseRequest | None = None):
        body = body or PauseRequest()
        mode = body.mode or default_mode()
        now = svc.runner.snapshot()
        if now.paused and now.pause_mode == mode and (mode == "hold" or not now.generating and (mode == "partial" or not now.active)):
            return service_status(svc)  # already paused this way: nothing to wait for
        try:
            await svc.runner.pause(mode, body.timeout_s or svc.cfg.rollout.pause_timeout_s)
        except PauseTimeout as exc:
            raise ApiError(504, f"pause did not complete: {exc}; the service stays paused",
                           service_status=service_status(svc)) from None
        return service_status(svc)

    @router.post("/resume", responses=errors(409))
    async def resume(body: ResumeRequest):
        current = svc.runner.snapshot().version
        if body.version < current:
            raise ApiError(409, f"version {body.version} is older than the current version {current}", param="version")
        await svc.runner.resume(body.version)
        return service_status(svc)

    @router.post("/validate", responses=errors(409))
    async def validate():
        if not svc.runner.snapshot().validation_configured:
            raise ApiError(409, "no validation set: set data.val_files")
        return await svc.validate()

    @router.get("/status")
    async def status():
        return service_status(svc)

    @router.post("/engines", responses=errors(409))
    async def add_engine(body: AddEngineRequest):
        try:
            svc.pool.add(str(body.url), body.id)
        except ValueError as exc:
            raise ApiError(409, str(exc), param="id") from None
        await svc.pool.check_once()
        return service_status(svc)

    @router.delete("/engines/{engine_id}")
    async def remove_engine(engine_id: str):
        if engine_id in svc.pool.engines:
            await svc.pool.remove(engine_id)
        return service_status(svc)

    @router.post("/engines/{engine_id}/quarantine", responses=errors(404))
    async def quarantine(engine_id: str, body: QuarantineRequest | None = None):
        body = body or QuarantineRequest()
        _known(engine_id)
        svc.pool.set_quarantine(engine_id, True, body.reason)
        return service_status(svc)

    @router.delete("/engines/{engine_id}/quarantine", responses=errors(404))
    async def release(engine_id: str):
        _known(engine_id)
        if svc.pool.engines[engine_id].state == "quarantined":
            svc.pool.set_quarantine(engine_id, False)
        return service_status(svc)

    def _known(engine_id: str) -> None:
        if engine_id not in svc.pool.engines:
            raise ApiError(404, f"no engine {engine_id!r}; known: {sorted(svc.pool.engines)}", param="engine_id")

    return router
