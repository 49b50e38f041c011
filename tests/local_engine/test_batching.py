"""Continuous batching: concurrent requests share decode steps; arrivals never wait for others."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import load

PROMPT = [21, 22, 23]


async def test_concurrent_requests_are_decoded_in_one_batch(engine, client):
    n = 8
    results = await asyncio.gather(*[
        client.generate(PROMPT + [i], {"max_new_tokens": 40, "temperature": 0.8, "ignore_eos": True}) for i in range(n)
    ])
    assert all(len(r.output_ids) == 40 for r in results)
    state = (await client.server_info())["internal_states"][0]
    assert state["max_decode_batch_size"] >= 4, state
    async with aiohttp.ClientSession() as s, s.get(f"{engine.url}/metrics") as r:
        text = await r.text()
    count_le_1 = _sample(text, 'local_engine_decode_batch_size_bucket{le="1.0"}')
    count_all = _sample(text, "local_engine_decode_batch_size_count")
    assert count_all > count_le_1, "some decode steps must have had more than one row"
    assert _sample(text, "sglang:generation_tokens_total") >= n * 40


async def test_new_request_joins_while_a_long_one_runs(client):
    long = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}, rid="joiner-long"))
    await wait_for(lambda: _running(client), WAIT_S, "the long request running")
    short = await asyncio.wait_for(client.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}), 30)
    assert len(short.output_ids) == 4
    assert not long.done(), "the short request finished while the long one was still decoding"
    await client.abort("joiner-long")
    assert (await asyncio.wait_for(long, 30)).finish_reason.type == "abort"


async def _running(client) -> bool:
    return (await load(client))["num_running_reqs"] == 1


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not in /metrics")
