"""``create_app(settings)``: the FastAPI app of one engine (no module-level state).

The engine (model, tokenizer, scheduler, weights) is built when the factory is called —
loading is synchronous, so a server that listens is ready — and its scheduler task runs
for the app's lifespan. Tests and tools may pass a ready :class:`Engine` instead.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from local_engine.auth import BearerAuth
from local_engine.engine import Engine
from local_engine.errors import install_error_handlers
from local_engine.openapi import install_openapi
from local_engine.settings import EngineSettings

log = logging.getLogger(__name__)


def create_app(settings: EngineSettings, engine: Engine | None = None) -> FastAPI:
    """Build the app; ``engine`` defaults to :meth:`Engine.from_settings`."""
    from local_engine import routes_admin, routes_generate, routes_info, routes_lora

    engine = engine or Engine.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        log.info("local_engine serving %s (vocab %d, max_model_len %d, max_batch_size %d) as sglang %s",
                 settings.model, engine.vocab_size, engine.max_model_len, settings.max_batch_size, settings.compat.version)
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="local_engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.engine = engine
    app.state.settings = settings
    install_error_handlers(app)
    app.include_router(routes_generate.router)
    app.include_router(routes_admin.router)
    app.include_router(routes_lora.router)
    if settings.compat.sessions:
        app.include_router(routes_admin.session_router)
    app.include_router(routes_info.router)
    if settings.api_key or settings.admin_api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key, admin_api_key=settings.admin_api_key,
                           sessions=settings.compat.sessions)
    install_openapi(app, authenticated=bool(settings.api_key or settings.admin_api_key))
    return app
