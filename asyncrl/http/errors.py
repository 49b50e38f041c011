"""One error envelope for every route, OpenAI-shaped:
``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``.

Malformed JSON and schema violations are 400 on every route (data plane and admin alike, as
OpenAI answers invalid parameters) with the offending field named; an
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

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status: the four specific ones, ``server_error`` for
    every 5xx, ``invalid_request_error`` for every other 4xx (409, 413, 415, 422 included)."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, **extra) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status, **extra}}


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
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error; see the service log")


class BodySizeLimit:
    """ASGI middleware: 413 for bodies above ``max_bytes``, whatever the framing.

    With a ``Content-Length`` above the limit: 413 before reading. Without one (chunked
    transfer encoding) the body is read here first, at most ``max_bytes`` (413 as soon as it
    passes the limit), then handed to the app whole: a framework that turns any error raised
    while it reads the body into a 400 ("error parsing the body") never sees the overflow.
    Memory per request is bounded by ``max_bytes`` either way."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> ASGIApp:
        return error_response(413, f"request body larger than {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for n, v in scope.get("headers", []) if n == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large()(scope, receive, send)
        if length is None and scope.get("method") not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            chunks, seen = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body = message.get("body", b"")
                seen += len(body)
                if seen > self.max_bytes:
                    return await self._too_large()(scope, receive, send)
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

            async def replayed() -> dict:
                return replay.pop() if replay else await receive()

            return await self.app(scope, replayed, send)
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
            await self._too_large()(scope, receive, send)


class _TooLarge(Exception):
    pass
