"""A real HTTP proxy on loopback that forwards to an engine and records what passes:

- ``requests``: every request (method, path, query, parsed JSON body or None), for checking
  what the product sends against SGLang's own request classes (tests/contract);
- ``exchanges``: every /generate request with its answer, so a test can compare what the
  engine returned with what a service published (streaming answers are buffered whole: the
  client gets every chunk, at once); an answer that came after its client had gone (a call the
  client took back) goes to ``undelivered`` instead: the client never saw it;
- ``intercept``: an optional ``(method, path, body) -> (status, json) | None``; a non-None
  answer is returned instead of forwarding (fault injection: an engine refusing a call the
  way SGLang refuses it, while the engine itself stays as it was);
- ``rewrite``: an optional ``(method, path, body) -> body | None``; a non-None body (parsed
  JSON) is forwarded instead of the client's (fault injection: a corrupted payload reaching
  the engine); what is recorded is what the client sent;
- an engine that drops the connection (it died): the proxy drops its client's too, without an
  answer, as the engine did;
- ``hold``: an optional ``asyncio.Event``; while it is set on the proxy and not yet set
  itself, every /generate (or those whose body ``hold_if`` accepts) waits for it before being
  forwarded, ``held`` counting them: the callers stay mid-generation for as long as a test
  needs. A held request whose client went away meanwhile is dropped, not forwarded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
from aiohttp import web

from asyncrl.launch import free_port


class RecordingProxy:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.exchanges: list[tuple[dict, dict]] = []
        self.undelivered: list[tuple[dict, dict]] = []
        self.requests: list[tuple[str, str, dict[str, str], object]] = []
        self.answers: list[tuple[str, int, object]] = []
        """(path, status, body: parsed JSON, else the text) of every forwarded call but ``/generate``."""
        self.intercept = None
        self.rewrite = None
        self.hold: asyncio.Event | None = None
        self.hold_if: Callable[[dict], bool] | None = None
        self.held = 0
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body
        self.requests.append((request.method, request.path, dict(request.query), parsed))
        if self.intercept is not None:
            answer = self.intercept(request.method, request.path, parsed)
            if answer is not None:
                return web.json_response(answer[1], status=answer[0])
        gate = self.hold
        if gate is not None and request.path == "/generate" and (self.hold_if is None or self.hold_if(parsed)):
            self.held += 1
            try:
                await gate.wait()
            finally:
                self.held -= 1
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # the client is gone: nothing to forward
        assert self._session is not None
        sent = body
        if self.rewrite is not None:
            changed = self.rewrite(request.method, request.path, parsed)
            if changed is not None:
                sent = json.dumps(changed).encode()
        try:
            async with self._session.request(request.method, self.target + request.path_qs, data=sent,
                                             headers={k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}) as resp:
                payload = await resp.read()
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise  # nothing listens there: answered 500 as before
            if request.transport is not None:
                request.transport.close()  # as the engine did: no answer
            raise
        if request.path != "/generate":
            try:
                self.answers.append((request.path, resp.status, json.loads(payload)))
            except ValueError:
                self.answers.append((request.path, resp.status, payload.decode(errors="replace")))
        if request.path == "/generate" and resp.status == 200:
            req = json.loads(body)
            if req.get("stream"):  # SSE: record the last cumulative chunk (the whole answer)
                chunks = [line[5:].strip() for line in payload.split(b"\n") if line.startswith(b"data:")]
                final = json.loads(next(c for c in reversed(chunks) if c != b"[DONE]"))
            else:
                final = json.loads(payload)
            gone = request.transport is None or request.transport.is_closing()
            (self.undelivered if gone else self.exchanges).append((req, final))
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
        await asyncio.sleep(0)  # one loop turn for the closed transports' callbacks (not a wait for a state)
