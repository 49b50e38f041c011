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

from asyncrl.engine_urls import engine_url_refusal
from asyncrl.launch import free_port
from tests.rollout.conftest import admin, running_service, service_config


@pytest.mark.parametrize(("url", "allowed", "ok"), [
    ("http://127.0.0.1:30000", [], True),  # a configured engine's endpoint
    ("http://127.0.0.1:31000", [], False),  # its host, another port: any local user's listener (issue 67 L2)
    ("http://127.0.0.1:31000", ["127.0.0.1:31000"], True),
    ("http://127.0.0.1:31001", ["127.0.0.1:31000"], False),
    ("http://127.0.0.1:31001", ["127.0.0.1"], True),  # a bare host: any of its ports, as the operator said
    ("http://[fd00::5]:30000", ["[fd00::5]:30000"], True),
    ("http://[fd00::5]:30001", ["[fd00::5]:30000"], False),
    ("http://[fd00::5]:30001", ["fd00::5"], True),
    ("http://engine-b", ["engine-b:80"], True),  # the scheme's port
    ("http://user:pw@127.0.0.1:30000", [], False),
    ("http://127.0.0.1:30000/?x=1", [], False),
    ("http://127.0.0.1:30000/#x", [], False),
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


def test_the_config_refuses_engine_urls_with_credentials_and_allow_entries_it_cannot_read():
    from asyncrl.config import load_config

    with pytest.raises(ValueError, match="user name or password"):
        load_config(None, ['engines.urls=["http://u:p@127.0.0.1:30000"]'], environ={})
    with pytest.raises(ValueError, match="not host, host:port"):
        load_config(None, ['engines.allowed_hosts=["10.0.0.1:notaport"]'], environ={})
    cfg = load_config(None, ['engines.allowed_hosts=["10.0.0.0/24", "[fd00::5]:30000", "engine-b:30000", "fd00::6"]'],
                      environ={})
    assert len(cfg.engines.allowed_hosts) == 4


async def test_the_engine_client_follows_no_redirect():
    """Issue 67 L2: an engine (or whatever answers at its URL) redirecting a call elsewhere
    does not get the key and the body re-sent there: the redirect is an error."""
    from asyncrl.engine_client import EngineClient, EngineHTTPError

    heard: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        heard.append(f"{request.method} {request.path} {request.headers.get('Authorization', '')}")
        return web.json_response({"success": True})

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{other}{request.path}")

    apps = []
    for handler in (elsewhere, redirect):
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        apps.append(runner)
    other, port = free_port(), free_port()
    await web.TCPSite(apps[0], "127.0.0.1", other).start()
    await web.TCPSite(apps[1], "127.0.0.1", port).start()
    try:
        async with EngineClient(f"http://127.0.0.1:{port}", api_key="k" * 16, admin_api_key="a" * 16) as c:
            with pytest.raises(EngineHTTPError) as got:
                await c.load_lora_adapter_from_tensors("x", {"r": 1}, "payload")
            assert got.value.status == 307
            with pytest.raises(EngineHTTPError):
                await c.generate([1, 2], {"max_new_tokens": 1})
        assert heard == []
    finally:
        for runner in apps:
            await runner.cleanup()


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
            # the configured engine's host, another port (issue 67 L2)
            status, body = await admin(http, "POST", f"{url}/admin/engines", {"url": f"http://127.0.0.1:{port}"})
            assert status == 403 and f"127.0.0.1:{port} is neither" in body["error"]["message"], body
            status, body = await admin(http, "POST", f"{url}/admin/engines", {"url": f"http://u:pw@127.0.0.1:{port}"})
            assert status == 400 and "user name or password" in body["error"]["message"], body
            await asyncio.sleep(0)  # one loop turn: nothing is scheduled to reach the listener
            status, body = await admin(http, "GET", f"{url}/admin/status")
            assert all("localhost" not in e["url"] for e in body["engines"])
        assert heard == []
    finally:
        await runner.cleanup()
