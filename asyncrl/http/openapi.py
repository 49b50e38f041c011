"""OpenAPI documents that say what the routes really answer.

FastAPI documents a route's success answer and a ``422 HTTPValidationError`` it never sends
here (validation errors are 400 with the error envelope: ``asyncrl.http.errors``). Apps call
:func:`document_errors` once all routes are added; their ``/openapi.json`` then gives every
operation:

- ``400`` (the envelope) when it takes a body or parameters (malformed JSON, a field out of
  range, ...), ``413`` when it takes a body (``BodySizeLimit``);
- ``401`` / ``403`` when ``authenticated(path)`` says it needs a bearer token;
- ``500`` (the envelope: an unexpected error is logged, never a traceback);
- whatever the route declares itself with ``responses=errors(404, 409, ...)`` or
  ``responses=streams(...)`` (``200`` as ``text/event-stream`` when ``stream`` is true);

and FastAPI's ``422`` is removed unless the route declared a 422 of its own. The schema of
the envelope is :class:`ErrorEnvelope`. ``tests/deploy/test_openapi_fuzz.py`` checks the
documents against the running services with schemathesis (no 5xx, no undocumented status).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

DESCRIPTIONS = {
    400: "invalid request: malformed JSON, a field missing or out of range (the field is named)",
    401: "no bearer token",
    403: "wrong bearer token",
    404: "not found",
    409: "conflict with the current state",
    413: "request body too large",
    422: "the request was valid but could not be satisfied",
    429: "too many requests (see Retry-After)",
    500: "unexpected error (logged; no traceback in the body)",
    502: "an upstream engine failed",
    503: "temporarily unavailable (see Retry-After)",
    504: "timed out",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorEnvelope(BaseModel):
    """Every error answer: ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape)."""

    error: ErrorDetail


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for error statuses a route answers, with the envelope schema."""
    return {s: {"model": ErrorEnvelope, "description": DESCRIPTIONS.get(s, "error")} for s in statuses}


def streams(description: str = "with `stream: true`: server-sent events, `data: {json}` chunks then `data: [DONE]`"):
    """``responses=`` entry documenting the SSE form of a route's 200."""
    return {200: {"description": "the answer; " + description,
                  "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}}}}


def _envelope_ref(name: str = "ErrorEnvelope") -> dict[str, Any]:
    return {"description": "", "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def document_errors(app: FastAPI, authenticated: Callable[[str], bool],
                    envelope_for: Callable[[str], type[BaseModel] | None] = lambda path: None) -> None:
    """Make ``app.openapi()`` document the generic error answers (module docstring).
    ``envelope_for(path)``: another error shape a path answers in (e.g. Anthropic's on the
    Messages routes), documented there instead of :class:`ErrorEnvelope`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        envelope = ErrorEnvelope.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(envelope.pop("$defs", {}))
        schemas["ErrorEnvelope"] = envelope
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                responses = op["responses"]
                declared_422 = "422" in responses and "HTTPValidationError" not in str(responses["422"])
                if not declared_422:
                    responses.pop("422", None)
                wanted = [500]
                if op.get("requestBody") or op.get("parameters"):
                    wanted.append(400)
                if op.get("requestBody"):
                    wanted.append(413)
                if authenticated(path):
                    wanted += [401, 403]
                for status in wanted:
                    entry = responses.setdefault(str(status), _envelope_ref())
                    entry["description"] = entry.get("description") or DESCRIPTIONS[status]
                other = envelope_for(path)
                if other is not None:
                    schemas[other.__name__] = other.model_json_schema(ref_template="#/components/schemas/{model}")
                    for status, entry in responses.items():
                        if status != "200" and "ErrorEnvelope" in str(entry.get("content")):
                            responses[status] = {**_envelope_ref(other.__name__), "description": entry.get("description", "")}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
