"""Typed errors of :class:`~asyncrl.engine_client.EngineClient`.

``EngineError`` is the base. ``EngineHTTPError`` carries the status and the engine's own
message, pulled out of whichever of SGLang's error shapes the body has (see
:func:`error_message`). ``EngineTimeout``: no answer within the call's limit.
``EngineUnavailable``: no connection, or the connection dropped mid-call.
"""

from __future__ import annotations

from typing import Any


class EngineError(Exception):
    """Base of every error the engine client raises."""


class EngineHTTPError(EngineError):
    """The engine answered with a non-2xx status."""

    def __init__(self, status: int, message: str, url: str = "", body: Any = None):
        super().__init__(f"HTTP {status} from {url}: {message}" if url else f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url
        self.body = body


class EngineTimeout(EngineError):
    """The call did not finish within its timeout."""


class EngineUnavailable(EngineError):
    """The engine could not be reached, or dropped the connection."""


def error_message(body: Any, fallback: str = "") -> str:
    """The human message inside any of SGLang's error bodies.

    Handles ``{"object":"error","message":..}``, ``{"error":{"message":..}}``,
    ``{"error":"text"}``, ``{"success":false,"message":..}``, LoRA routes'
    ``{"success":false,"error_message":..}``, FastAPI's ``{"detail":..}`` and plain text.
    """
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message") is not None:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message") is not None:
            return str(body["message"])
        if body.get("error_message"):
            return str(body["error_message"])
        if body.get("detail") is not None:
            return str(body["detail"])
        return str(body)
    if isinstance(body, str) and body.strip():
        return body.strip()
    return fallback


class PausedWhileRouting(EngineError):
    """A router gave up on a call before sending it: the rollout paused for a sync while the call
    waited for a routable engine (none was). It is at no engine, so the caller goes back to its
    gate instead of holding the pause, which waits for every call in flight, until the pause
    times out. Not a failure of the call (nothing was sent)."""
