"""/abort_request: partial results of running requests, the queued shape, and SGLang's rid
rule (a rid the engine does not track exactly aborts nothing; a tracked one ends every
request whose rid starts with it)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import load, running_tokens

PROMPT = [5, 6, 7, 8]
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}


async def test_abort_running_returns_partial_prefix_of_greedy(client, ref_model):
    task = asyncio.create_task(client.generate(PROMPT, LONG, rid="abort-me-123"))
    await wait_for(lambda: _over(client, len(PROMPT) + 8), WAIT_S, "the long request to produce tokens")
    await client.abort("abort-me-123")
    res = await asyncio.wait_for(task, 30)
    assert res.finish_reason.type == "abort" and res.finish_reason.message == "Aborted"
    n = len(res.output_ids)
    assert 8 <= n < 3000 and res.completion_tokens == n and len(res.logprobs) == n
    full = await client.generate(PROMPT, {**LONG, "max_new_tokens": n})
    assert full.output_ids == res.output_ids
    assert max(abs(a - b) for a, b in zip(res.logprobs, full.logprobs, strict=True)) < 1e-5
    expected = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids)
    assert max(abs(a - b) for a, b in zip(res.logprobs, expected, strict=True)) < 1e-4


async def _over(client, tokens: int) -> bool:
    return await running_tokens(client) > tokens


async def test_prefix_of_a_rid_aborts_nothing_as_on_sglang(client):
    """SGLang's tokenizer drops a rid it does not track exactly: a prefix is a no-op."""
    task = asyncio.create_task(client.generate(PROMPT, LONG, rid="prefix-only-7"))
    await wait_for(lambda: _over(client, len(PROMPT) + 4), WAIT_S, "the request to produce tokens")
    await client.abort("prefix-only")
    at_abort = await running_tokens(client)
    await wait_for(lambda: _over(client, at_abort + 20), WAIT_S, "the request to keep generating after the prefix abort")
    assert not task.done()
    await client.abort("prefix-only-7")
    res = await asyncio.wait_for(task, 30)
    assert res.finish_reason.type == "abort" and len(res.output_ids) >= at_abort + 20 - len(PROMPT)


async def test_exact_rid_also_ends_rids_it_prefixes_as_sglangs_scheduler_does(client):
    """Once the tokenizer knows the rid, SGLang's scheduler matches by prefix: "job-1" also
    ends "job-10". asyncrl's rids never prefix each other; this pins the engine's side."""
    short = asyncio.create_task(client.generate(PROMPT, LONG, rid="job-1"))
    longer = asyncio.create_task(client.generate(PROMPT, LONG, rid="job-10"))
    await wait_for(lambda: _over(client, 2 * len(PROMPT) + 4), WAIT_S, "both requests running")
    await client.abort("job-1")
    results = await asyncio.wait_for(asyncio.gather(short, longer), 30)
    assert all(r.finish_reason.type == "abort" for r in results)


async def test_abort_all_and_unknown_rid(client):
    tasks = [asyncio.create_task(client.generate(PROMPT, LONG, rid=f"all-{i}")) for i in range(3)]
    await wait_for(lambda: _over(client, 3 * len(PROMPT) + 6), WAIT_S, "three requests running")
    await client.abort("no-such-request")  # ignored
    assert not any(t.done() for t in tasks)
    await client.abort(abort_all=True)
    results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(r.finish_reason.type == "abort" and r.output_ids for r in results)


async def test_abort_in_waiting_queue_shape(small_engine, small_client):
    running = [asyncio.create_task(small_client.generate(PROMPT, LONG, rid=f"fill-{i}")) for i in range(2)]
    await wait_for(lambda: _running(small_client, 2), WAIT_S, "two running requests")
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}, "rid": "queued-x"}
    async with aiohttp.ClientSession() as s:
        queued = asyncio.create_task(s.post(f"{small_engine.url}/generate", json=body))
        await wait_for(lambda: _waiting(small_client, 1), WAIT_S, "one queued request")
        await small_client.abort("queued-x")
        resp = await asyncio.wait_for(queued, 30)
        assert resp.status == 200
        out = await resp.json()
        resp.release()
    assert out["text"] == "" and out["output_ids"] == []
    meta = out["meta_info"]
    assert meta["id"] == "queued-x" and meta["completion_tokens"] == 0 and "prompt_tokens" not in meta
    assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"] == "Abort in waiting queue"
    assert "weight_version" in meta and "e2e_latency" in meta
    assert not any(t.done() for t in running)
    await small_client.abort(abort_all=True)
    for r in await asyncio.wait_for(asyncio.gather(*running), 30):
        assert r.finish_reason.type == "abort"


async def _running(client, n: int) -> bool:
    return (await load(client))["num_running_reqs"] == n


async def _waiting(client, n: int) -> bool:
    return (await load(client))["num_waiting_reqs"] == n


async def _held_then_aborted_twice(url: str, rid: str) -> tuple:
    """A request that arrives while the engine is paused (held at the gate) gets an exact-rid
    abort there; after continue, once it is running, the same abort is sent again."""
    from asyncrl.engine_client import EngineClient

    async with EngineClient(url) as c:
        await c.pause("abort")
        try:
            task = asyncio.create_task(c.generate(PROMPT, {**LONG, "max_new_tokens": 400}, rid=rid))
            await wait_for(lambda: _waiting_at_gate(url), WAIT_S, "the request held at the pause gate")
            await c.abort(rid)  # the tokenizer knows it; the scheduler does not have it yet
        finally:
            await c.resume()
        await wait_for(lambda: _over(c, len(PROMPT) + 8), WAIT_S, "the request running after continue")
        await c.abort(rid)  # the same abort again
        return await asyncio.wait_for(task, 60)


async def _waiting_at_gate(url: str) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return any(line.startswith("local_engine_gate_waiting ") and float(line.split()[1]) >= 1 for line in text.splitlines())


@pytest.mark.parametrize(("compat", "second_abort_works"), [("0.5.19", True), ("0.5.20", False), ("0.5.23", False)])
async def test_an_abort_used_up_at_the_gate_drops_its_repeats_from_0_5_20(tmp_path, compat, second_abort_works):
    """SGLang 0.5.20+ passes one abort per rid to the scheduler (``abort_sent``): one that came
    while the request was held at the pause gate is used up, and every repeat is dropped, so
    the request runs to its end; 0.5.19 passes every repeat (issue 35 items 2 and 5)."""
    from tests.helpers.processes import start_engine

    with start_engine(tmp_path, "--sglang-compat", compat, name=f"engine-{compat}") as engine:
        res = await _held_then_aborted_twice(engine.url, f"held-{compat.replace('.', '-')}")
    if second_abort_works:
        assert res.finish_reason.type == "abort" and len(res.output_ids) < 400
    else:
        assert res.finish_reason.type == "length" and len(res.output_ids) == 400
