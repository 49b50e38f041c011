"""A real HTTP proxy on loopback that forwards to an engine and records every /generate
exchange, so a test can compare what the engine returned with what a service published.
Streaming answers are buffered whole (the client gets every chunk, at once)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from asyncrl.launch import free_port


class RecordingProxy:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.exchanges: list[tuple[dict, dict]] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        assert self._session is not None
        async with self._session.request(request.method, self.target + request.path_qs, data=body,
                                         headers={k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}) as resp:
            payload = await resp.read()
            if request.path == "/generate" and resp.status == 200:
                req = json.loads(body)
                if req.get("stream"):  # SSE: record the last cumulative chunk (the whole answer)
                    chunks = [line[5:].strip() for line in payload.split(b"\n") if line.startswith(b"data:")]
                    final = json.loads(next(c for c in reversed(chunks) if c != b"[DONE]"))
                else:
                    final = json.loads(payload)
                self.exchanges.append((req, final))
            return web.Response(body=payload, status=resp.status, content_type=resp.content_type)

    async def start(self) -> "RecordingProxy":
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        await asyncio.sleep(0)
