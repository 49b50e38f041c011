"""/pause_generation modes (abort, in_place, retract with its re-prefill), /continue_generation,
/flush_cache while paused."""

from __future__ import annotations

import asyncio
import copy

import aiohttp
import pytest

from asyncrl import failpoints
from asyncrl.engine_client import EngineHTTPError
from tests.helpers.reference_model import greedy_continuation, teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.helpers import load, paused_gauge, running_tokens
from tests.local_engine.weight_trainer import perturb

PROMPT = [9, 10, 11, 12]
STEP = "local_engine.step"
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


async def test_pause_in_place_keeps_requests_and_they_finish_after_continue(small_engine, small_client):
    """The generation is held mid-way (failpoint ``local_engine.step``) until the pause has
    reached the engine, so the pause always meets it running (a loaded CI machine once let it
    finish its 200 tokens first)."""
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    reference = await small_client.generate(PROMPT, sp)
    task = asyncio.create_task(small_client.generate(PROMPT, sp, rid="ip-run"))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 10), WAIT_S, "tokens before the pause")
    points = small_engine.failpoints
    (points / f"{STEP}.arm").touch()
    try:
        await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the generation")
        pause = asyncio.create_task(small_client.pause("in_place"))
        await wait_for(lambda: _paused(small_engine), WAIT_S, "the pause to reach the engine")
    finally:
        (points / f"{STEP}.arm").unlink()
        (points / f"{STEP}.release").touch()
    await pause
    for f in points.iterdir():
        f.unlink()
    before = await running_tokens(small_client)
    await asyncio.sleep(0.5)  # not a wait for a state: room for a wrong engine to take a step while paused
    assert await running_tokens(small_client) == before, "no steps while paused in place"
    assert (await load(small_client))["num_running_reqs"] == 1 and not task.done()
    async with aiohttp.ClientSession() as s, s.get(f"{small_client.base_url}/flush_cache") as r:
        assert r.status == 400  # a request is still pending
    held = asyncio.create_task(small_client.generate(PROMPT, {"max_new_tokens": 2}))
    await asyncio.sleep(HOLD_S)  # not a wait for a state: room for a wrong engine to answer while paused
    assert not held.done() and not task.done()
    await small_client.update_weight_version(5, abort_all_requests=False)
    try:
        await small_client.resume()
        res = await asyncio.wait_for(task, 60)
        await asyncio.wait_for(held, 30)
        assert res.finish_reason.type == "length" and res.output_ids == reference.output_ids
        k = before - len(PROMPT)
        spans = [(s.version, s.start, s.end) for s in res.weight_versions]
        assert spans[0][0] == 0 and spans[-1] == (5, spans[-1][1], 200)  # "default" reads as 0
        assert spans[0][2] == spans[-1][1] and abs(spans[0][2] - k) <= 1
        assert res.weight_version == 5
        assert res.token_versions()[0] == 0 and res.token_versions()[-1] == 5
    finally:
        await small_client.update_weight_version(0, abort_all_requests=False)


async def test_retract_frees_the_kv_and_prefills_again_with_the_new_weights(small_client, ref_model, tmp_path):
    """``retract``: the running request goes back to the queue (no row, no KV), a flush now
    works (0.5.21+ ignore the queue of a paused engine), and after the update and continue it
    is prefilled again: every token after the pause is the new model's greedy choice with the
    new model's logprob over the WHOLE context (prompt + earlier output recomputed with the new
    weights, which an in-place pause would not do), and ``num_retractions`` is 1."""
    n = RETRACT_TOKENS  # long enough that it cannot finish between the first tokens and the pause
    new = perturb(copy.deepcopy(ref_model), 31)
    new.save_pretrained(tmp_path / "new")
    ref_model.save_pretrained(tmp_path / "base")
    task = asyncio.create_task(small_client.generate(PROMPT, {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
                                                     rid="retract-run"))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 2), WAIT_S, "tokens before the pause")
    await small_client.pause("retract")
    try:
        loads = await load(small_client)
        assert loads["num_running_reqs"] == 0 and loads["num_waiting_reqs"] == 1 and not task.done()
        await small_client.flush_cache(retries=1, interval_s=0.1)
        await small_client.update_weights_from_disk(str(tmp_path / "new"), weight_version=6, flush_cache=True)
        await small_client.resume()
        res = await asyncio.wait_for(task, 120)
    finally:
        await small_client.resume()
        await small_client.update_weights_from_disk(str(tmp_path / "base"), weight_version=0)
    assert res.finish_reason.type == "length" and len(res.output_ids) == n
    assert res.meta_info["num_retractions"] == 1
    assert res.cached_tokens == 0, "the flush dropped the prompt's KV: the re-prefill computed it again"
    spans = [(s.version, s.start, s.end) for s in res.weight_versions]
    assert len(spans) == 2 and spans[0][:2] == (0, 0) and spans[1] == (6, spans[0][2], n)
    k = spans[0][2]
    head = res.output_ids[:k]
    checked = 24  # a prefix of the new span is enough to tell the semantics apart
    assert res.output_ids[k:k + checked] == greedy_continuation(new, PROMPT + head, checked)
    want = teacher_forced_logprobs(new, PROMPT, res.output_ids[:k + checked])[k:]
    assert max(abs(a - b) for a, b in zip(res.logprobs[k:k + checked], want, strict=True)) < 1e-4
    old_ctx = teacher_forced_logprobs(ref_model, PROMPT, res.output_ids[:k])
    assert max(abs(a - b) for a, b in zip(res.logprobs[:k], old_ctx, strict=True)) < 1e-4  # the old span: the old weights


async def test_retract_up_to_0_5_20_resumes_over_the_old_weights_prompt_kv(ref_model, tmp_path):
    """Issue 35 item 4: on SGLang 0.5.20 and older the flush after a retract is refused while the
    retracted request is queued, so the radix cache keeps its prompt's KV, computed with the old
    weights, and the re-prefill after the update matches it: the tokens after the sync are the
    new weights' over old-weight prompt KV (and their own output recomputed), not exactly the
    new policy's. ``cached_tokens`` counts the prompt."""
    import torch

    from tests.helpers.processes import start_engine

    points = tmp_path / "failpoints"
    points.mkdir()
    new = perturb(copy.deepcopy(ref_model), 37)
    new.save_pretrained(tmp_path / "new")
    with start_engine(tmp_path, "--sglang-compat", "0.5.20", env={failpoints.ENV_DIR: str(points)}, name="engine-0.5.20") as engine:
        async with engine.client() as c:
            task = asyncio.create_task(c.generate(PROMPT, {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
                                                  rid="retract-old"))
            await wait_for(lambda: _tokens_over(c, len(PROMPT) + 4), WAIT_S, "tokens before the pause")
            (points / f"{STEP}.arm").touch()  # the generation stays mid-way until the pause has reached it
            await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the generation")
            pause = asyncio.create_task(c.pause("retract"))
            try:
                await wait_for(lambda: _paused(engine), WAIT_S, "the pause to reach the engine")
            finally:
                (points / f"{STEP}.release").touch()
                (points / f"{STEP}.arm").unlink()
            await pause
            try:
                with pytest.raises(EngineHTTPError, match="400"):
                    await c.flush_cache(retries=1)  # 0.5.20: the queued retracted request blocks it
                await c.update_weights_from_disk(str(tmp_path / "new"), weight_version=7, flush_cache=False)
            finally:
                await c.resume()
            res = await asyncio.wait_for(task, 120)
    assert res.meta_info["num_retractions"] == 1 and res.cached_tokens == len(PROMPT)
    k = res.weight_versions[0].end
    assert 4 <= k < 64 and res.weight_versions[1].version == 7
    checked = res.output_ids[:k + 16]
    with torch.no_grad():  # old weights' prompt KV, then the new weights over the output so far
        kv = ref_model(input_ids=torch.tensor([PROMPT]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([checked]), past_key_values=kv, use_cache=True).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    want = [float(lp[j - 1, checked[j]]) for j in range(k, len(checked))]
    assert res.output_ids[k:k + 16] == [int(lp[j - 1].argmax()) for j in range(k, len(checked))]
    assert max(abs(a - b) for a, b in zip(res.logprobs[k:k + 16], want, strict=True)) < 1e-4
    exact = teacher_forced_logprobs(new, PROMPT, checked)[k:]
    assert max(abs(a - b) for a, b in zip(res.logprobs[k:k + 16], exact, strict=True)) > 1e-3, "not the new policy's exactly"


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


async def _flush(client, timeout_s: float) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(f"{client.base_url}/flush_cache", params={"timeout": str(timeout_s)}) as r:
        return r.status, await r.text()


async def test_a_flush_with_a_timeout_waits_for_the_engine_to_be_idle(small_client):
    """``/flush_cache?timeout=T`` (SGLang's SchedulerFlushWrapper): it flushes the moment nothing
    runs or waits; a second flush while one waits is refused; an engine held busy past ``T``
    (paused in place, or retracted requests queued while paused) answers 'Timed out waiting
    for idle state.', although an immediate flush of the retracted engine succeeds (0.5.21+)."""
    for bad in ("-1", "soon"):  # Query(0.0, ge=0.0), as SGLang declares it: refused, never a 500
        async with aiohttp.ClientSession() as s, s.get(f"{small_client.base_url}/flush_cache", params={"timeout": bad}) as r:
            assert 400 <= r.status < 500 and "timeout" in await r.text(), (bad, r.status)
    task = asyncio.create_task(small_client.generate(PROMPT, LONG, rid="flush-run"))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 2), WAIT_S, "tokens from the running request")
    waiting = asyncio.create_task(_flush(small_client, 120))

    async def refused_as_in_progress() -> bool:  # before the waiting flush arrives: 'Flush cache failed.'
        return await _flush(small_client, 0) == (400, "Another flush_cache is already in progress.")

    await wait_for(refused_as_in_progress, WAIT_S, "the flush to wait while the request runs")
    assert not waiting.done() and not task.done()
    await small_client.abort(rid="flush-run")
    assert (await asyncio.wait_for(waiting, 120))[0] == 200 and (await asyncio.wait_for(task, 30)).finish_reason.type == "abort"
    assert await _flush(small_client, 5) == (200, (await _flush(small_client, 0))[1])  # idle: at once
    held = asyncio.create_task(small_client.generate(PROMPT, LONG, rid="flush-held"))
    await wait_for(lambda: _tokens_over(small_client, len(PROMPT) + 2), WAIT_S, "tokens before the pause")
    for mode, immediate in (("in_place", 400), ("retract", 200)):
        await small_client.pause(mode)
        try:
            assert await _flush(small_client, 0.3) == (400, "Timed out waiting for idle state.")
            assert (await _flush(small_client, 0))[0] == immediate
        finally:
            await small_client.resume()
    await small_client.abort(rid="flush-held")
    assert (await asyncio.wait_for(held, 60)).finish_reason.type == "abort"


async def _paused(engine) -> bool:
    return await paused_gauge(engine.url) == 1.0
