"""/pause_generation modes, /continue_generation, /flush_cache while paused."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import load, running_tokens

PROMPT = [9, 10, 11, 12]
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
RETRACT_TOKENS = 1500
HOLD_S = 1.0  # how long a blocked request must stay blocked to count as held


async def test_pause_abort_aborts_running_and_holds_new_until_continue(small_client):
    running = asyncio.create_task(small_client.generate(PROMPT, LONG, rid="pa-run"))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 4), WAIT_S, "tokens from the running request")
    await small_client.pause("abort")
    res = await asyncio.wait_for(running, 30)
    assert res.finish_reason.type == "abort" and len(res.output_ids) >= 4
    await small_client.flush_cache(retries=3, interval_s=0.1)  # nothing pending any more
    held = asyncio.create_task(small_client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0}))
    await asyncio.sleep(HOLD_S)  # not a wait for a state: room for a wrong engine to answer while paused
    assert not held.done(), "a paused engine must hold new requests"
    await small_client.resume()
    out = await asyncio.wait_for(held, 30)
    assert out.finish_reason.type != "abort" and len(out.output_ids) == 3


async def test_pause_in_place_keeps_requests_and_they_finish_after_continue(small_client):
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    reference = await small_client.generate(PROMPT, sp)
    task = asyncio.create_task(small_client.generate(PROMPT, sp, rid="ip-run"))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 10), WAIT_S, "tokens before the pause")
    await small_client.pause("in_place")
    before = await running_tokens(small_client)
    await asyncio.sleep(0.5)  # not a wait for a state: room for a wrong engine to take a step while paused
    assert await running_tokens(small_client) == before, "no steps while paused in place"
    assert (await load(small_client))["num_running_reqs"] == 1 and not task.done()
    async with aiohttp.ClientSession() as s, s.get(f"{small_client.base_url}/flush_cache") as r:
        assert r.status == 400  # a request is still pending
    held = asyncio.create_task(small_client.generate(PROMPT, {"max_new_tokens": 2}))
    await asyncio.sleep(HOLD_S)  # not a wait for a state: room for a wrong engine to answer while paused
    assert not held.done() and not task.done()
    await small_client.update_weight_version("v-in-place", abort_all_requests=False)
    try:
        await small_client.resume()
        res = await asyncio.wait_for(task, 60)
        await asyncio.wait_for(held, 30)
        assert res.finish_reason.type == "length" and res.output_ids == reference.output_ids
        k = before - len(PROMPT)
        spans = [(s.version, s.start, s.end) for s in res.weight_versions]
        assert spans[0][0] == "default" and spans[-1] == ("v-in-place", spans[-1][1], 200)
        assert spans[0][2] == spans[-1][1] and abs(spans[0][2] - k) <= 1
        assert res.weight_version == "v-in-place"
        assert res.token_versions()[0] == "default" and res.token_versions()[-1] == "v-in-place"
    finally:
        await small_client.update_weight_version("default", abort_all_requests=False)


async def test_retract_mode_behaves_like_in_place(small_client):
    # long enough that it cannot finish between the first tokens and the pause, even on a loaded box
    # (60 tokens once did, under two CPU hogs): the pause, not the request's length, must hold it
    n = RETRACT_TOKENS
    task = asyncio.create_task(small_client.generate(PROMPT, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 2), WAIT_S, "tokens before the pause")
    await small_client.pause("retract")
    before = await running_tokens(small_client)
    await asyncio.sleep(0.3)  # not a wait for a state: room for a wrong engine to go on with the request while paused
    assert not task.done() and await running_tokens(small_client) == before, "no steps while paused"
    await small_client.resume()
    res = await asyncio.wait_for(task, 120)
    assert res.finish_reason.type == "length" and len(res.output_ids) == n


async def test_pause_and_continue_require_a_body_like_sglang(small_engine, small_client):
    """SGLang 0.5.15+ declares both bodies required: no body is a 400, ``{}`` is the default."""
    async with aiohttp.ClientSession() as s:
        for path in ("/pause_generation", "/continue_generation"):
            async with s.post(f"{small_engine.url}{path}") as r:
                assert r.status == 400 and "body" in (await r.json())["message"]
        assert (await small_client.server_info())["internal_states"][0]["paused"] is False
        async with s.post(f"{small_engine.url}/pause_generation", json={}) as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        info = await small_client.server_info()
        assert info["internal_states"][0]["paused"] is True and info["internal_states"][0]["pause_mode"] == "abort"
        async with s.post(f"{small_engine.url}/continue_generation", json={}) as r:
            assert r.status == 200
    assert (await small_client.server_info())["internal_states"][0]["paused"] is False


async def _tokens_over(client, n: int) -> bool:
    return await running_tokens(client) > n
