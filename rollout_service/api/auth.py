"""Bearer-token checks. The admin token and the data-plane token are different secrets;
comparisons are constant-time. A service refuses to start with an empty or well-known
admin token unless ``security.insecure_dev`` (``--insecure-dev``) is set, and off loopback it
refuses ``--insecure-dev`` and an open data plane (no ``security.api_token``).

Per-session tokens (OpenAI sessions, parked external tool calls) are the foundation's
(:mod:`asyncrl.http.session_tokens`). This module imports nothing else of the service."""

from __future__ import annotations

import hmac

from fastapi import Request

from asyncrl.http.binding import bind_refusal
from asyncrl.http.errors import ApiError

WEAK_TOKENS = {"", "changeme", "change-me", "admin", "token", "secret", "password", "default", "test"}


class InsecureConfig(ValueError):
    """Refusing to start: the admin token is missing or weak."""


def _strong(token: str | None) -> bool:
    return token is not None and token.strip().lower() not in WEAK_TOKENS and len(token) >= 12


def check_tokens(admin_token: str | None, api_token: str | None, insecure_dev: bool, host: str = "127.0.0.1") -> None:
    """Raise :class:`InsecureConfig` when the service must not start: a weak admin token
    (unless ``insecure_dev``), ``insecure_dev`` off loopback, or an open data plane (no
    ``api_token``) off loopback (:func:`asyncrl.http.binding.bind_refusal`)."""
    refusal = bind_refusal(host, insecure_dev, _strong(api_token), "security.api_token (ASYNCRL_SECURITY__API_TOKEN)")
    if refusal:
        raise InsecureConfig(refusal)
    if insecure_dev:
        return
    if not _strong(admin_token):
        raise InsecureConfig("security.admin_token is empty, default or shorter than 12 characters; "
                             "set a real secret (ASYNCRL_SECURITY__ADMIN_TOKEN) or pass --insecure-dev for local development")
    if api_token is not None and hmac.compare_digest(admin_token, api_token):
        raise InsecureConfig("security.admin_token must differ from security.api_token")


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def client_key(request: Request) -> str | None:
    """The bearer token, else an ``x-api-key`` header (what Anthropic's clients send): the
    data plane and session tokens accept either; the admin token only the bearer."""
    return bearer(request) or (request.headers.get("x-api-key") or "").strip() or None


def require_token(request: Request, expected: str | None, what: str, api_key_header: bool = False) -> None:
    """401 without a token, 403 with a wrong one; no-op when ``expected`` is None (open).
    ``api_key_header``: an ``x-api-key`` header is accepted as well (:func:`client_key`)."""
    if expected is None:
        return
    got = client_key(request) if api_key_header else bearer(request)
    if got is None:
        also = " (or 'x-api-key: <token>')" if api_key_header else ""
        raise ApiError(401, f"{what} requires 'Authorization: Bearer <token>'{also}", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(got.encode(), expected.encode()):
        raise ApiError(403, f"invalid {what} token")
