"""The rollout service's FastAPI app: health, metrics and the admin router.

``create_app(service)`` builds the app around a :class:`RolloutService` (its lifecycle, and
the narrow ports each router gets from it: ``admin_ports``, ``openai_context``,
``metrics_sources``); the OpenAI-compatible routes and sessions join it in their own routers.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from asyncrl.chat import TemplateError
from asyncrl.http.errors import BodySizeLimit, error_response, install_error_handlers
from asyncrl.http.openapi import document_errors
from rollout_service.api.admin import build_admin_router
from rollout_service.metrics import build_registry, render
from rollout_service.openai.messages_errors import AnthropicErrors, envelope_for
from rollout_service.openai.routes import build_openai_router


def create_app(svc, *, manage_lifecycle: bool = True) -> FastAPI:
    """The app; with ``manage_lifecycle`` the service starts and closes with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_lifecycle:
            await svc.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await svc.close()

    app = FastAPI(title="asyncrl rollout service", lifespan=lifespan)
    install_error_handlers(app)

    @app.exception_handler(TemplateError)
    async def _template(request, exc: TemplateError):  # user input the chat template cannot render: the request's fault
        return error_response(400, str(exc), param="messages")
    app.add_middleware(BodySizeLimit, max_bytes=svc.cfg.api.max_body_bytes)
    app.add_middleware(AnthropicErrors)  # outermost: its rewrite covers the size limit's 413 too
    registry = build_registry(svc.metrics_sources())

    @app.get("/health")
    async def health():
        return JSONResponse(svc.liveness(), status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(render(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(build_admin_router(svc.admin_ports()))
    app.include_router(build_openai_router(svc.openai_context()))
    public = ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
    document_errors(app, authenticated=lambda path: path not in public, envelope_for=envelope_for)
    return app
