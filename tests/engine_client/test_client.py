"""EngineClient against a real local_engine and an old-SGLang stand-in: typed results and errors."""

from __future__ import annotations

import time

import pytest

from asyncrl.engine_client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
    GenerateResult,
)
from asyncrl.launch import free_port
from tests.helpers.processes import CLIENT_TIMEOUT_S
from tests.helpers.waiting import wait_for

PROMPT = [3, 1, 4, 1, 5]


async def test_generate_returns_typed_result(client_engine):
    async with client_engine.client() as c:
        res = await c.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, rid="typed-1")
    assert isinstance(res, GenerateResult) and res.rid == "typed-1"
    assert len(res.output_ids) == len(res.logprobs) == 5 and all(lp <= 0 for lp in res.logprobs)
    assert res.finish_reason.type == "length" and res.finish_reason.length == 5 and not res.aborted
    assert res.prompt_tokens == 5 and res.completion_tokens == 5 and res.cached_tokens == 0
    assert res.weight_version == 0 and res.token_versions() == [0] * 5  # "default" reads as 0
    assert res.e2e_latency is not None and res.e2e_latency > 0


async def test_control_calls_against_local_engine(client_engine):
    async with client_engine.client() as c:
        assert await c.health() is True
        assert (await c.model_info())["weight_version"] == "default"
        assert (await c.server_info())["tp_size"] == 1
        assert (await c.loads())["loads"][0]["num_running_reqs"] == 0
        await c.pause("in_place")
        await c.resume()
        await c.flush_cache(retries=2, interval_s=0.05)
        await c.abort(abort_all=True)
        with pytest.raises(ValueError):
            await c.abort()


@pytest.mark.parametrize(
    ("sampling", "needle"),
    [({"max_new_tokens": "x"}, "max_new_tokens"), ({"top_k": 0}, "top_k")],
)
async def test_validation_error_is_typed_with_message(client_engine, sampling, needle):
    async with client_engine.client() as c:
        with pytest.raises(EngineHTTPError) as err:
            await c.generate(PROMPT, sampling)
    assert err.value.status == 400 and needle in err.value.message


async def test_refused_request_and_failed_weight_update_are_typed(client_engine):
    async with client_engine.client() as c:
        with pytest.raises(EngineHTTPError) as err:
            await c.generate([1, 10**6], {})
        assert err.value.status == 400 and "out of vocabulary" in err.value.message
        with pytest.raises(EngineHTTPError) as err:
            await c.update_weights_from_distributed(["w"], ["float32"], [[2]])
        assert err.value.status == 400 and "must run between begin_weight_update()" in err.value.message
        assert err.value.body["success"] is False
        assert await c.begin_weight_update() is True
        try:
            with pytest.raises(EngineHTTPError) as err:
                await c.update_weights_from_distributed(["w"], ["float32"], [[2]])
            assert err.value.status == 400 and "init_weights_update_group" in err.value.message
        finally:
            assert await c.end_weight_update() is True


async def test_timeout_raises_and_engine_drops_the_request(client_engine):
    async with client_engine.client() as c:
        started = time.monotonic()
        with pytest.raises(EngineTimeout):
            await c.generate(PROMPT, {"max_new_tokens": 3000, "ignore_eos": True}, rid="will-time-out", timeout_s=0.5)
        assert time.monotonic() - started < 5
        await wait_for(lambda: _idle(c), 15, "the engine to abort a request whose client left")


async def test_unreachable_engine_is_unavailable():
    async with EngineClient(f"http://127.0.0.1:{free_port()}", control_timeout_s=5, request_timeout_s=5) as c:
        with pytest.raises(EngineUnavailable):
            await c.health()
        with pytest.raises(EngineError):
            await c.generate(PROMPT, {})


@pytest.mark.parametrize(
    ("rid", "status", "message"),
    [
        ("shape-validation", 400, "bad field x"),
        ("shape-valueerror", 400, "token id 9 out of vocab"),
        ("shape-unauthorized", 401, "Unauthorized"),
        ("shape-detail", 422, "field required"),
        ("shape-success-false", 400, "weights refused"),
        ("shape-text", 503, "engine overloaded"),
    ],
)
async def test_error_message_from_every_shape(old_server, rid, status, message):
    url, _ = old_server
    async with EngineClient(url, control_timeout_s=CLIENT_TIMEOUT_S) as c:
        with pytest.raises(EngineHTTPError) as err:
            await c.generate(PROMPT, {}, rid=rid)
    assert err.value.status == status and err.value.message == message


async def test_old_server_fallbacks(old_server):
    url, state = old_server
    state["flush_calls"] = 0
    async with EngineClient(url, api_key="data", admin_api_key="admin", control_timeout_s=CLIENT_TIMEOUT_S) as c:
        await c.pause("abort")
        await c.resume()
        assert state["bodies"]["/pause_generation"] == [b'{"mode":"abort"}', b""]
        assert state["bodies"]["/continue_generation"] == [b"{}", b""]
        with pytest.raises(EngineHTTPError) as err:  # an old server cannot pause in place: say so
            await c.pause("in_place")
        assert err.value.status == 422 and state["bodies"]["/pause_generation"][-1] == b'{"mode":"in_place"}'
        assert (await c.model_info())["weight_version"] == "7"
        assert await c.weight_version() == 7
        assert (await c.server_info())["version"] == "0.5.4"
        assert (await c.loads())["loads"][0]["dp_rank"] == 0
        await c.flush_cache(retries=5, interval_s=0.01)
        assert state["flush_calls"] == 3
        state["health"] = 503
        assert await c.health() is False
        state["health"] = 200
        assert await c.health() is True
    assert state["auth"]["/pause_generation"] == "Bearer admin"
    assert state["auth"]["/flush_cache"] == "Bearer admin"
    assert state["auth"]["/get_model_info"] == "Bearer data"


async def test_flush_cache_gives_up_after_retries(old_server):
    url, state = old_server
    state["flush_calls"], state["flush_busy"] = 0, 100
    try:
        async with EngineClient(url) as c:
            with pytest.raises(EngineHTTPError) as err:
                await c.flush_cache(retries=3, interval_s=0.01)
        assert err.value.status == 400 and "after 3 tries" in err.value.message and state["flush_calls"] == 3
    finally:
        state["flush_busy"] = 2


async def _idle(c: EngineClient) -> bool:
    return (await c.loads())["loads"][0]["num_running_reqs"] == 0


@pytest.mark.parametrize(("release", "sessions"), [("0.5.18", False), ("0.5.23", True)])
async def test_weight_sessions_follow_the_release_with_an_admin_key(tmp_path, release, sessions):
    """Found on a real SGLang 0.5.18 server (tests/sglang/test_sync_policies.py): with an admin key
    configured, ``/begin_weight_update`` on a release without sessions is an unknown route, which
    SGLang's auth treats as a normal one: the admin key got 401, and every sync failed. The client
    reads the release and calls no session route before 0.5.21."""
    from tests.helpers.processes import start_engine

    with start_engine(tmp_path, "--sglang-compat", release, api_key="api-key-0123456789", admin_api_key="admin-key-0123456789",
                      name=f"sessions-{release}") as engine:
        async with engine.client() as c:
            assert await c.begin_weight_update() is sessions
            assert await c.end_weight_update() is sessions
