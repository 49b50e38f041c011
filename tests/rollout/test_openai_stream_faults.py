"""A streamed chat completion survives an engine connection dropped mid-stream, end to end
(real service, real engine behind a proxy that cuts the first streamed /generate after a few
events): the engine retry continues after the tokens the service had received (the ones it
already streamed to its client), and the session records exactly those tokens and the retry's."""

from __future__ import annotations

import json

import aiohttp
import httpx
from aiohttp import web
from openai import AsyncOpenAI

from asyncrl.launch import free_port
from tests.rollout.conftest import running_service
from tests.rollout.test_openai_api import QUESTION, idle_cfg, new_session

CUT_AFTER_EVENTS = 2


class CuttingProxy:
    """Forwards to an engine; the first streamed /generate is cut after ``cut_after`` SSE
    events by closing the client's connection (the engine's request is closed too). Records
    each streamed request's input ids with the output ids of the last event the client got."""

    def __init__(self, target: str, cut_after: int) -> None:
        self.target, self.cut_after = target.rstrip("/"), cut_after
        self.streams: list[tuple[list[int], list[int]]] = []
        self.cut = False
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        streamed = request.path == "/generate" and json.loads(body).get("stream")
        async with self._session.request(request.method, self.target + request.path_qs, data=body, headers=headers) as up:
            if not streamed:
                return web.Response(body=await up.read(), status=up.status, content_type=up.content_type)
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            cut_now, events, last = not self.cut, 0, []
            async for line in up.content:
                if line.startswith(b"data: {"):
                    last = json.loads(line[6:])["output_ids"]
                    events += 1
                await resp.write(line)
                if cut_now and events >= self.cut_after:
                    break
        self.streams.append((json.loads(body)["input_ids"], last))
        if cut_now and events >= self.cut_after:
            self.cut = True
            assert request.transport is not None
            request.transport.close()  # the client sees the connection drop mid-stream
        else:
            await resp.write_eof()
        return resp

    async def start(self) -> "CuttingProxy":
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


async def test_a_streamed_turn_survives_a_connection_dropped_mid_stream(tmp_path, nats_server, warm_engine):
    proxy = await CuttingProxy(warm_engine, CUT_AFTER_EVENTS).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            sess = await new_session(url)
            client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120, max_retries=0)
            stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": QUESTION}],
                                                          temperature=0, max_tokens=32, stream=True)
            chunks = [c async for c in stream]
            assert proxy.cut, "the first streamed request was cut mid-stream"
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finishes and finishes[-1] in ("stop", "length", "tool_calls"), finishes
            async with httpx.AsyncClient() as http:
                state = (await http.get(f"{url}/v1/sessions/{sess['id']}", headers={"Authorization": f"Bearer {sess['token']}"})).json()
    finally:
        await proxy.stop()
    (first_in, first_out), (second_in, second_out) = proxy.streams
    assert first_out, "the proxy sent tokens before the cut"
    # The service continues after the tokens it received: the event written just before the
    # connection was cut may not have reached it (the cut races its delivery), so the retry
    # starts from a non-empty prefix of what the proxy sent, never more and never a gap.
    got = second_in[len(first_in):]
    assert second_in[:len(first_in)] == first_in and got and got == first_out[:len(got)], (first_out, got)
    assert state["turns"] == 1 and state["model_tokens"] == len(got) + len(second_out)


async def test_a_stream_closed_mid_turn_leaves_the_session_as_it_was(tmp_path, nats_server, warm_engine):
    """The client reads the first chunk of a streamed session turn and goes away while the
    engine is still generating (held by the proxy, so the turn cannot finish first): the
    partial turn is dropped, the session is as before the request, and sending the same
    request again continues the same segment."""
    import asyncio

    from tests.helpers.recording_proxy import RecordingProxy
    from tests.helpers.waiting import wait_for

    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url), \
                httpx.AsyncClient(timeout=120) as http:
            sess = await new_session(url)
            auth = {"Authorization": f"Bearer {sess['token']}"}
            chat_url = f"{sess['base_url']}/chat/completions"
            messages = [{"role": "user", "content": QUESTION}]
            first = await http.post(chat_url, json={"model": "policy", "messages": messages, "max_tokens": 4, "temperature": 0},
                                    headers=auth)
            assert first.status_code == 200, first.text
            messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
            before = (await http.get(f"{url}/v1/sessions/{sess['id']}", headers=auth)).json()
            proxy.hold = asyncio.Event()
            body = {"model": "policy", "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True}
            async with http.stream("POST", chat_url, json=body, headers=auth) as streamed:
                assert streamed.status_code == 200
                lines = streamed.aiter_lines()
                assert (await anext(lines)).startswith("data: {")  # the role chunk: the turn is under way
                await wait_for(lambda: proxy.held >= 1, 60, "the engine call to be held")
            await wait_for(lambda: svc.sessions.abandoned_streams == 1, 60, "the service to see the stream closed")
            proxy.hold.set()
            proxy.hold = None
            after = (await http.get(f"{url}/v1/sessions/{sess['id']}", headers=auth)).json()
            assert {k: after[k] for k in ("tokens", "turns", "model_tokens", "segments", "divergences")} == \
                   {k: before[k] for k in ("tokens", "turns", "model_tokens", "segments", "divergences")}
            again = await http.post(chat_url, json={**body, "stream": False}, headers=auth)
            assert again.status_code == 200, again.text
            state = (await http.get(f"{url}/v1/sessions/{sess['id']}", headers=auth)).json()
            assert state["turns"] == 2 and state["segments"] == 1 and state["divergences"] == []
    finally:
        await proxy.stop()
