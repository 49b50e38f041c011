"""Bearer-token auth with SGLang's three levels (pure ASGI, so disconnects still reach routes).

- ``/health*``, ``/ready*`` and ``/metrics``: always open (probes and scrapers);
- admin routes (weights, LoRA adapters, pause, continue, abort, flush): the admin key when one is set,
  else the api key when set, else open — a data-plane token cannot pause or reload;
- everything else: the api key when set, else open.

Keys are compared in constant time; the scheme is matched without case (``bearer`` too). A
refusal is ``401 {"error": "Unauthorized"}``, SGLang's own body (``srt/utils/auth.py``, every
release 0.5.15-0.5.23; checked against a real 0.5.23 server by tests/sglang/test_differential.py).
"""

from __future__ import annotations

import hmac

import orjson

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_PATHS = frozenset({
    "/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
    "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weight_version",
    "/begin_weight_update", "/end_weight_update", "/weights_checker",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/slow_down",
})


def _matches(header: str | None, key: str) -> bool:
    parts = (header or "").split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return hmac.compare_digest(parts[1].encode(), key.encode())


SESSION_PATHS = frozenset({"/begin_weight_update", "/end_weight_update"})
"""Admin routes from 0.5.21 only: before, they do not exist, and an unknown route is a normal one
(the API key opens it, then 404)."""


def required_key(path: str, api_key: str | None, admin_api_key: str | None, sessions: bool = True) -> str | None:
    """The key a request to ``path`` must present, or None when it is open (``sessions``: the
    emulated release has the weight-update session routes, 0.5.21+)."""
    if path.startswith(OPEN_PREFIXES):
        return None
    if path in ADMIN_PATHS and (sessions or path not in SESSION_PATHS):
        return admin_api_key or api_key
    return api_key


class BearerAuth:
    """ASGI middleware enforcing :func:`required_key`."""

    def __init__(self, app, api_key: str | None, admin_api_key: str | None, sessions: bool = True):
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.sessions = sessions

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        key = required_key(scope["path"], self.api_key, self.admin_api_key, self.sessions)
        if key is not None:
            header = None
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            if not _matches(header, key):
                body = orjson.dumps({"error": "Unauthorized"})
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        return await self.app(scope, receive, send)
