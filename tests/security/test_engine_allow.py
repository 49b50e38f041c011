"""Issue 48 item 2: the admin token no longer collects the engines' keys. ``POST /admin/engines``
used to accept any URL, after which the rollout service sent the engine API key there (and the
next sync the engine admin key, pause and load calls and adapter tensors). Now an engine added
at run time must be on a configured engine's host or an ``engines.allowed_hosts`` entry; else
403 naming the setting, and the listener hears nothing. The sync agent ignores (and never
calls) an engine the rollout lists that its config does not allow."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from asyncrl.engine_client.allowed import engine_url_refusal
from asyncrl.launch import free_port
from tests.rollout.conftest import admin, running_service, service_config


@pytest.mark.parametrize(("url", "allowed", "ok"), [
    ("http://127.0.0.1:31000", [], True),  # a configured engine's host, another port
    ("http://10.0.0.13:30000", [], False),
    ("http://10.0.0.13:30000", ["10.0.0.0/24"], True),
    ("http://10.0.1.13:30000", ["10.0.0.0/24"], False),
    ("http://engine-b:30000", ["engine-b"], True),
    ("http://engine-b.evil:30000", ["engine-b"], False),
    ("http://[fd00::5]:30000", ["fd00::/64"], True),
    ("http://localhost:31000", [], False),  # compared as written: not 127.0.0.1
    ("not a url", ["0.0.0.0/0"], False),
])
def test_which_engine_urls_are_allowed(url, allowed, ok):
    assert (engine_url_refusal(url, ["http://127.0.0.1:30000"], allowed) is None) is ok


async def test_an_engine_outside_the_allowed_hosts_is_refused_and_hears_nothing(tmp_path, nats_server, warm_engine):
    heard: list[str] = []

    async def listen(request: web.Request) -> web.Response:
        heard.append(f"{request.method} {request.path} {request.headers.get('Authorization', '')}")
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", listen)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1",
                             "engines.api_key=engine-key-0123456789")
        async with running_service(cfg) as (_svc, url), aiohttp.ClientSession() as http:
            status, body = await admin(http, "POST", f"{url}/admin/engines", {"url": f"http://localhost:{port}"})
            assert status == 403 and "engines.allowed_hosts" in body["error"]["message"], body
            await asyncio.sleep(0)  # one loop turn: nothing is scheduled to reach the listener
            status, body = await admin(http, "GET", f"{url}/admin/status")
            assert all("localhost" not in e["url"] for e in body["engines"])
        assert heard == []
    finally:
        await runner.cleanup()
