"""The sync agent's look at the engines does not wait on an engine that missed its last
probe (sync_agent/liveness.py), and sees it again as soon as it answers. The engine is a real
HTTP server on loopback that, while "hung", accepts requests and never answers (what a
SIGSTOPped server looks like from the client)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

import sync_agent.liveness as liveness_module
from asyncrl.engine_client import EngineClient
from asyncrl.launch import free_port
from sync_agent.liveness import EngineLiveness


@pytest.fixture
async def engine():
    answering = asyncio.Event()  # set: it answers, the requests it held too (SIGCONT)

    async def model_info(request):
        await answering.wait()
        return web.json_response({"model_path": "m", "weight_version": "3"})

    app = web.Application()
    app.router.add_get("/model_info", model_info)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = EngineClient(f"http://127.0.0.1:{port}")
    try:
        yield answering, client
    finally:
        answering.set()
        await client.close()
        await runner.cleanup()


async def test_a_silent_engine_is_not_waited_for_and_is_seen_again_once_it_answers(engine, monkeypatch):
    answering, client = engine
    monkeypatch.setattr(liveness_module, "LIVENESS_TIMEOUT_S", 0.5)
    monkeypatch.setattr(liveness_module, "RECHECK_TIMEOUT_S", 600.0)  # a background probe never gives up by itself here
    live = EngineLiveness(control_timeout_s=30.0)
    try:
        assert await live.model_info("e", client) is None  # the first miss costs the liveness timeout
        assert live.silent == {"e"}
        # later looks return at SILENT_WAIT_S although the engine's probe is still waiting (600 s)
        for _ in range(3):
            assert await asyncio.wait_for(live.model_info("e", client), 30) is None
        assert len([t for t in live._rechecks.values() if not t.done()]) == 1, "one background probe per engine"
        answering.set()  # it answers again: the pending probe gets its answer
        async def seen() -> bool:
            return await live.model_info("e", client) is not None
        for _ in range(100):
            if await seen():
                break
        else:
            raise AssertionError("the engine answering again was never seen")
        assert live.silent == set()
        assert (await live.model_info("e", client))["weight_version"] == "3"
    finally:
        await live.close()


async def test_an_engine_marked_silent_by_a_sync_is_asked_briefly(engine, monkeypatch):
    answering, client = engine
    monkeypatch.setattr(liveness_module, "LIVENESS_TIMEOUT_S", 600.0)  # a first probe would wait the whole test out
    live = EngineLiveness(control_timeout_s=600.0)
    live.mark_silent({"e"})  # the sync saw it stop answering while loading
    try:
        assert await asyncio.wait_for(live.model_info("e", client), 30) is None
    finally:
        await live.close()
