"""Anthropic's error shape on the Messages routes (issue 52).

Every route answers errors in OpenAI's envelope (:mod:`asyncrl.http.errors`); an Anthropic
client expects ``{"type": "error", "error": {"type": ..., "message": ...}}`` with Anthropic's
error types. :class:`AnthropicErrors` is an ASGI middleware that rewrites the JSON error
bodies (status >= 400) of the paths ending in ``/v1/messages`` — the session route and the
stateless one — whatever raised them: validation, authentication, a missing session, the body
size limit, a failed turn. Other paths and successful answers pass through untouched. The
OpenAI envelope's ``param`` is kept in the message (Anthropic's shape has no field for it).
"""

from __future__ import annotations

import json

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_SUFFIX = "/v1/messages"
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorEnvelope(BaseModel):
    """An error answer on the Messages routes: ``{"type": "error", "error": {"type", "message"}}``."""

    type: str
    error: AnthropicErrorDetail


def anthropic_shaped(path: str) -> bool:
    return path.rstrip("/").endswith(MESSAGES_SUFFIX)


def envelope_for(path: str) -> type[BaseModel] | None:
    """The OpenAPI document's error shape for ``path`` (:func:`asyncrl.http.openapi.document_errors`)."""
    return AnthropicErrorEnvelope if anthropic_shaped(path) else None


def anthropic_error_type(status: int) -> str:
    if status in _TYPES:
        return _TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error(status: int, body: bytes) -> bytes:
    """The Anthropic body for an error answer ``body`` (OpenAI's envelope, or anything else)."""
    try:
        err = json.loads(body).get("error") or {}
        message = str(err.get("message") or "error")
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")[:1000] or "error"
    return json.dumps({"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}).encode()


class AnthropicErrors:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not anthropic_shaped(scope.get("path", "")):
            return await self.app(scope, receive, send)
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                if message["status"] >= 400 and ctype.startswith(b"application/json"):
                    start = message
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = anthropic_error(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, rewriting)
