"""Error envelopes (SGLang's shapes), body parsing and the app's exception handlers.

Shapes, as the contract lists them:

- schema / JSON errors: ``400 {"object":"error","message":..,"type":"Bad Request","param":null,"code":400}``
- a request the engine refuses for its content (SGLang raises ValueError): ``400 {"error":{"message":..}}``
- ``sampling_params`` that do not decode (an unknown key, a wrong type) on 0.5.22+, whose
  contract gate answers with a string: ``400 {"error": ".."}`` (:class:`ContractError`); before,
  the TypeError escapes the route: ``500 Internal Server Error`` in plain text (:class:`InternalError`)
- an unknown route or method: FastAPI's ``{"detail": "Not Found"}`` (404, 405), as SGLang
- local_engine's own limits (413 body too large) and 500: ``{"object":"error","message":..,"type":"<status>","code":<status>}``

Each shape was observed on a real SGLang 0.5.23 server (tests/sglang/test_differential.py).

Every route parses its body through :func:`parse_body`, so bad JSON, a non-object body,
wrong types and out-of-range values all end as 400 with a JSON body. Anything unexpected
becomes a 500 envelope without a traceback (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger(__name__)

# Largest request body accepted (bytes). A 128k-token prompt as JSON is about 1 MB; this
# leaves room while keeping a hostile 100 MB body from being parsed at all.
MAX_BODY_BYTES = 32 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


class JSONResp(Response):
    """JSON response rendered with orjson."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class BadRequest(Exception):
    """A request that fails validation: answered 400 in the validation shape."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Refused(Exception):
    """A well-formed request the engine refuses: 400 ``{"error":{"message":..}}`` by
    default, or another status (e.g. 500 for what SGLang answers with a failed assert)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def validation_body(message: str) -> dict:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def http_error(status: int, message: str) -> JSONResp:
    return JSONResp({"object": "error", "message": message, "type": str(status), "code": status}, status_code=status)


def refused_response(message: str, status: int = 400) -> JSONResp:
    return JSONResp({"error": {"message": message}}, status_code=status)


RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "value_error",
                          "finite_number"})
"""pydantic error types of a value out of its range (or refused by a validator), as opposed to a
wrong type: SGLang refuses those in ``SamplingParams.verify`` (a ValueError)."""


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "__root__")
        msg = str(err.get("msg", "invalid"))
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request body"


def validate(model: type[M], data: Any) -> M:
    """``model.model_validate(data)``, raising :class:`BadRequest` with a readable message."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc)) from None


class ContractError(Exception):
    """``sampling_params`` SGLang 0.5.22+'s contract gate (a msgspec decode) refuses: answered
    ``400 {"error": "<message>"}`` (a string, not an object)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InternalError(Exception):
    """What SGLang answers when an exception escapes its route (before 0.5.22, ``sampling_params``
    with an unknown key or a wrong type: a TypeError): ``500 Internal Server Error``, plain text."""


class TooLarge(Exception):
    """A body over :data:`MAX_BODY_BYTES`: answered 413 before it is read in full."""


async def read_capped(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, refusing (413) a declared or streamed size over ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[M], *, optional: bool = False, limit: int = MAX_BODY_BYTES) -> M:
    """Read and validate a JSON object body of at most ``limit`` bytes. ``optional``: an empty
    body means ``{}`` (old clients call /pause_generation and /continue_generation without one)."""
    raw = await read_capped(request, limit)
    if not raw.strip():
        if optional:
            return validate(model, {})
        raise BadRequest("a JSON object body is required")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"body must be a JSON object, not {type(data).__name__}")
    return validate(model, data)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn every failure into one of the envelopes above."""

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> Response:
        return JSONResp(validation_body(exc.message), status_code=400)

    @app.exception_handler(TooLarge)
    async def _too_large(_: Request, exc: TooLarge) -> Response:
        return http_error(413, str(exc))

    @app.exception_handler(Refused)
    async def _refused(_: Request, exc: Refused) -> Response:
        return refused_response(exc.message, exc.status)

    @app.exception_handler(RequestValidationError)
    async def _schema(_: Request, exc: RequestValidationError) -> Response:
        return JSONResp(validation_body(str(exc.errors())), status_code=400)

    @app.exception_handler(InternalError)
    async def _internal_error(_: Request, exc: InternalError) -> Response:
        log.error("answered 500 as SGLang's server does: %s", exc)
        return Response("Internal Server Error", status_code=500, media_type="text/plain")

    @app.exception_handler(ContractError)
    async def _contract(_: Request, exc: ContractError) -> Response:
        return JSONResp({"error": exc.message}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code in (404, 405):  # FastAPI's own answer, which SGLang keeps
            return JSONResp({"detail": str(exc.detail)}, status_code=exc.status_code)
        return http_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return http_error(500, f"internal error ({type(exc).__name__}); see the engine log")
