"""The python tool's side of a python sandbox server (:mod:`tools.sandbox_server`): send a
program, get the tool result, over a unix socket.

``RemoteSandbox("unix:///run/asyncrl-sandbox/python.sock").run(code, wall_s)`` POSTs (aiohttp over the
socket, with the shared keep-alive of :mod:`asyncrl.http.keepalive`)
``{"code", "timeout_s"}`` to ``/v1/run`` and returns the server's :class:`~tools.base.ToolResult`
(its ``metadata["isolation"]`` says what the server's launcher put in effect). It waits at most
``wall_s`` plus :data:`TRANSPORT_GRACE_S` (the server's own cleanup); a server that cannot be
reached, answers garbage or overruns gives an error result with ``failure="sandbox_unavailable"``
(never an exception: the model sees a tool error, the trajectory goes on).

Who may connect is decided by the socket file's owner and mode (the server makes it ``0600``,
owned by the service's uid); there is no token. Not covered: TCP servers; retries (a lost
answer is reported as unavailable, the program is not run twice).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from asyncrl.http.keepalive import unix_client_session
from tools.base import ToolResult

log = logging.getLogger(__name__)

TRANSPORT_GRACE_S = 5.0  # beyond the run's own wall time: the server kills, sweeps and deletes
MAX_RESPONSE_BYTES = 4 * 2**20  # a result is bounded by the server's max_output_bytes; this bounds a broken one


class RemoteSandbox:
    def __init__(self, url: str) -> None:
        if not url.startswith("unix://"):
            raise ValueError(f"sandbox_url must be unix:///path/to/socket, got {url!r}")
        self.url = url
        self.socket_path = url.removeprefix("unix://")

    async def run(self, code: str, wall_s: float) -> ToolResult:
        timeout = aiohttp.ClientTimeout(total=wall_s + TRANSPORT_GRACE_S)
        try:
            async with unix_client_session(self.socket_path, timeout=timeout) as http, \
                    http.post("http://python-sandbox/v1/run", json={"code": code, "timeout_s": wall_s}) as response:
                body = await response.content.read(MAX_RESPONSE_BYTES + 1)
                status = response.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("python sandbox server %s: %s: %s", self.url, type(exc).__name__, exc)
            return ToolResult.error("Error: the python sandbox is unavailable; try again later.",
                                    failure="sandbox_unavailable", detail=f"{type(exc).__name__}: {exc}"[:300])
        return _result(status, body, self.url)


def _result(status: int, raw: bytes, url: str) -> ToolResult:
    body: Any = None
    if len(raw) <= MAX_RESPONSE_BYTES:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
    ok = status == 200 and isinstance(body, dict) and isinstance(body.get("content"), str)
    if not ok:
        log.warning("python sandbox server %s answered %d: %s", url, status, raw[:300])
        return ToolResult.error("Error: the python sandbox is unavailable; try again later.",
                                failure="sandbox_unavailable", detail=f"HTTP {status}")
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    return ToolResult(content=body["content"], is_error=bool(body.get("is_error")), metadata=metadata)
