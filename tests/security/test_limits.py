"""What a client can hold open is bounded (issue 30 item 11): stateless completions in
progress, tool-call long-polls waiting, and the metadata a session keeps."""

from __future__ import annotations

import asyncio

import httpx
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.http.errors import ApiError
from rollout_service.api.limits import InflightLimit, hold_until_sent
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import running_service, service_config

API = "data-plane-token-0123456789"


async def test_a_stream_holds_its_slot_until_its_last_byte_or_the_client_leaves():
    limit = InflightLimit(1, "stateless completions")

    async def body():
        for part in (b"a", b"b"):
            yield part

    held = hold_until_sent(StreamingResponse(body()), limit.take())
    try:
        limit.take()
        raise AssertionError("a second request got a slot")
    except ApiError as exc:
        assert exc.status == 429 and "limit 1" in str(exc) and exc.headers["Retry-After"]
    assert [c async for c in held.body_iterator] == [b"a", b"b"] and limit.active == 0
    left = hold_until_sent(StreamingResponse(body()), limit.take())
    it = left.body_iterator
    assert await it.__anext__() == b"a"
    await it.aclose()  # the client went away mid-stream
    assert limit.active == 0
    hold_until_sent(JSONResponse({}), limit.take())
    assert limit.active == 0


async def test_long_polls_and_session_metadata_are_bounded(tmp_path, nats_server, warm_engine):
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1", "api.max_long_polls=1",
                         "api.max_session_metadata_bytes=1024", "async_training.staleness_threshold=50",
                         f"security.api_token={API}")
    async with running_service(cfg) as (svc, url), httpx.AsyncClient(timeout=60) as http:
        api = {"Authorization": f"Bearer {API}"}
        big = await http.post(f"{url}/v1/sessions", json={"metadata": {"x": "y" * 2000}}, headers=api)
        assert big.status_code == 400 and "metadata" in big.json()["error"]["message"], big.text
        ok = await http.post(f"{url}/v1/sessions", json={"metadata": {"x": "y" * 100}}, headers=api)
        assert ok.status_code == 201, ok.text
        first = asyncio.create_task(http.get(f"{url}/v1/environments/arith/tool_calls", params={"wait": 8}, headers=api))
        await wait_for(lambda: svc.inflight_polls.active == 1, 30, "the first long-poll to wait")
        second = await http.get(f"{url}/v1/environments/arith/tool_calls", params={"wait": 8}, headers=api)
        assert second.status_code == 429 and second.headers["Retry-After"], second.text
        quick = await http.get(f"{url}/v1/environments/arith/tool_calls", headers=api)  # no wait: not a long-poll
        assert quick.status_code == 200
        first.cancel()
        await wait_for(lambda: svc.inflight_polls.active == 0, 30, "the abandoned long-poll to give its slot back")
