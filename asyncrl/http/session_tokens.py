"""Per-session tokens (OpenAI sessions, parked external tool calls): random, handed out once,
stored only as their SHA-256, compared in constant time. In the foundation so that the agents
(who park tool calls) and the API (which opens sessions) share it without one importing the
other (issue 68 item 1: the rollout service's agent → api → runner → agent room circle)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from asyncrl.http.errors import ApiError


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "sess-" + secrets.token_urlsafe(24)


def check_token(expected_hash: str, given: str | None, what: str = "session") -> None:
    """401 without a token, 403 when ``given`` does not hash to ``expected_hash``."""
    if given is None:
        raise ApiError(401, f"{what} routes require 'Authorization: Bearer <{what} token>' (or 'x-api-key: <{what} token>')",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(hash_token(given), expected_hash):
        raise ApiError(403, f"invalid {what} token")
