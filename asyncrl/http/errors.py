"""One error envelope for every route, OpenAI-shaped:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.

Malformed JSON and schema violations are 400/422 with the offending field named; an
unexpected exception is a 500 with a generic message (logged, never a traceback in the
body). Request bodies above the configured size get 413 before they are read whole.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          409: "conflict_error", 413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None, **extra) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": status, **extra}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None, **extra) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, **extra), status_code=status, headers=headers)


class ApiError(Exception):
    """Raise from a route to answer with the envelope."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None, **extra) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.extra = status, message, param, headers, extra


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param, exc.headers, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        where = ".".join(loc) or "body"
        status = 400 if request.url.path.startswith("/v1/") else 422  # OpenAI answers 400 to invalid parameters
        return error_response(status, f"{where}: {first.get('msg', 'invalid value')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error; see the service log")


class BodySizeLimit:
    """ASGI middleware: 413 for bodies above ``max_bytes`` (by Content-Length, or while reading)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await error_response(413, f"request body larger than {self.max_bytes} bytes")(scope, receive, send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await error_response(413, f"request body larger than {self.max_bytes} bytes")(scope, receive, send)


class _TooLarge(Exception):
    pass
