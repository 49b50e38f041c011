"""The engine's OpenAPI document (``GET /openapi.json``, as SGLang's server has one).

The routes read their bodies themselves (:func:`local_engine.errors.parse_body`, for
SGLang's error shapes), so FastAPI cannot see them: :data:`BODIES` names each route's body
model, and :func:`install_openapi` puts it in the document with every status the route can
answer. Statuses for every operation: ``400`` (bad JSON or a field out of range, SGLang's
``{"object": "error", ...}`` shape, or a refused request ``{"error": {"message"}}``), ``413``
with a body, ``500`` (SGLang answers 500 where its handlers fail an assertion; local_engine
does too, deliberately), ``401`` when an API key is configured; plus :data:`EXTRA`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from local_engine.protocol import (
    AbortBody,
    ContinueBody,
    DestroyGroupBody,
    GenerateBody,
    InitGroupBody,
    PauseBody,
    SessionBody,
    SlowDownBody,
    UpdateDiskBody,
    UpdateDistributedBody,
    UpdateVersionBody,
)

BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateBody,
    "/abort_request": AbortBody,
    "/pause_generation": PauseBody,
    "/continue_generation": ContinueBody,
    "/begin_weight_update": SessionBody,
    "/end_weight_update": SessionBody,
    "/init_weights_update_group": InitGroupBody,
    "/destroy_weights_update_group": DestroyGroupBody,
    "/update_weights_from_distributed": UpdateDistributedBody,
    "/update_weights_from_disk": UpdateDiskBody,
    "/update_weight_version": UpdateVersionBody,
    "/slow_down": SlowDownBody,
}
OPTIONAL_BODY = {"/pause_generation", "/continue_generation", "/abort_request"}
EXTRA: dict[str, tuple[int, ...]] = {
    "/health": (503,), "/health_generate": (503,), "/generate": (503,),
    "/get_weight_version": (404,), "/weight_version": (404,),  # removed in SGLang: 404 naming /model_info
    "/get_load": (404,),  # removed in SGLang 0.5.21: 404 when emulating it or later
}
SSE_ROUTES = {"/generate"}
_ERROR = {"content": {"application/json": {"schema": {"type": "object"}}}}
_DESCRIPTIONS = {400: "invalid or refused request", 401: "missing or wrong API key",
                 404: "removed in the emulated SGLang release (the weight version: /model_info; loads: /v1/loads)",
                 413: "body too large",
                 500: "internal error (also where SGLang fails an assertion)", 503: "not healthy / not serving"}


def install_openapi(app: FastAPI, authenticated: bool) -> None:
    """Serve a document that describes the routes as they behave (module docstring)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, ops in doc.get("paths", {}).items():
            model = BODIES.get(path)
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                statuses = [400, 500, *EXTRA.get(path, ())]
                if model is not None and method in ("post", "put"):
                    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                    schemas.update(schema.pop("$defs", {}))
                    schemas[model.__name__] = schema
                    op["requestBody"] = {"required": path not in OPTIONAL_BODY,
                                         "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                    statuses.append(413)
                if authenticated:
                    statuses.append(401)
                if path in SSE_ROUTES:
                    responses["200"] = {"description": "the result; with `stream: true` server-sent events",
                                        "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}}
                for status in statuses:
                    responses.setdefault(str(status), {"description": _DESCRIPTIONS.get(status, "error"), **_ERROR})
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
