"""local_engine fails where SGLang fails (docs/local_engine.md, "SGLang fidelity").

Three engines, each behaving like one SGLang release (``--sglang-compat``):

- ``new``: 0.5.23 with ``--tp-size 2`` and ``SGLANG_HEALTH_CHECK_TIMEOUT=2``;
- ``old``: 0.5.18 with ``--dp-size 2 --enable-dp-attention`` (allowed by that release);
- ``dp``: 0.5.23 with ``--dp-size 2`` (refused by it) and ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``.

The sender side is driven by hand here (one gloo group hosted in this process) so each test
can bend one step of the protocol; the product's own sequence runs in the last tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time

import aiohttp
import pytest
import torch

from asyncrl.engine_client import EngineClient, EngineHTTPError
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import host_group, pack_bucket, reserve_listen_socket
from tests.helpers.processes import start_engine
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.local_engine.weight_trainer import perturb
from trainer_daemon.sync.direct import DirectEnginePublisher

TIMEOUT_S = 60.0
PROMPT = [31, 41, 59, 26, 53]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
NORM = "model.norm.weight"  # a small float32 parameter of builtin:tiny (128 values)


@pytest.fixture(scope="module")
def new(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("new"), "--sglang-compat", "0.5.23", "--tp-size", "2",
                        "--weight-sync-timeout-s", "60", name="sglang-0.5.23", env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}) as e:
        yield e


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("old"), "--sglang-compat", "0.5.18", "--dp-size", "2",
                        "--enable-dp-attention", "--weight-sync-timeout-s", "60", name="sglang-0.5.18") as e:
        yield e


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("dp"), "--sglang-compat", "0.5.23", "--dp-size", "2", name="sglang-dp",
                        env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}) as e:
        yield e


@contextlib.asynccontextmanager
async def joined(engine, ranks: int):
    """A gloo group hosted here with ``engine`` joined at rank offset 1 (``ranks`` ranks)."""
    async with engine.client() as c:
        sock = reserve_listen_socket("127.0.0.1")
        port = sock.getsockname()[1]
        init = asyncio.ensure_future(c.init_weights_update_group("127.0.0.1", port, 1, 1 + ranks, backend="gloo"))
        group = await asyncio.to_thread(host_group, "127.0.0.1", port, 1 + ranks, timeout_s=TIMEOUT_S, listen_socket=sock)
        await asyncio.wait_for(init, TIMEOUT_S)
        try:
            yield c, group
        finally:
            group.destroy()
            with contextlib.suppress(EngineHTTPError):
                await c.end_weight_update()
            await c.destroy_weights_update_group()
            await c.resume()


def update(c: EngineClient, names, dtypes, shapes, **kw) -> asyncio.Future:
    return asyncio.ensure_future(c.update_weights_from_distributed(names, dtypes, shapes, load_format="flattened_bucket",
                                                                   flush_cache=False, timeout_s=TIMEOUT_S, **kw))


async def test_server_info_reports_the_layout_and_release(new, old, dp):
    for engine, layout in ((new, (2, 1, "0.5.23")), (old, (1, 2, "0.5.18")), (dp, (1, 2, "0.5.23"))):
        async with engine.client() as c:
            info = await c.server_info()
        assert (info["tp_size"], info["dp_size"], info["version"]) == layout and info["pp_size"] == 1


async def test_nothing_reports_weight_consistency(new):
    async with new.client() as c:
        texts = [str(await c.model_info()), str(await c.server_info())]
    async with aiohttp.ClientSession() as s, s.get(new.url + "/metrics") as r:
        texts.append(await r.text())
    assert not any("consistent" in t for t in texts)


async def test_an_update_outside_a_session_is_refused_without_joining_the_broadcast(new):
    async with joined(new, 2) as (c, group):
        refused = update(c, [NORM], ["float32"], [[128]])
        with pytest.raises(EngineHTTPError) as err:
            await asyncio.wait_for(refused, 10)  # answered at once: the engine never entered the broadcast
        assert err.value.status == 400 and "must run between begin_weight_update() and end_weight_update()" in err.value.message
        assert await c.begin_weight_update() is True
        with pytest.raises(EngineHTTPError) as err:
            await c.begin_weight_update()
        assert err.value.status == 400 and "already open" in err.value.message
        accepted = update(c, [NORM], ["float32"], [[128]], weight_version=41)
        await asyncio.to_thread(group.broadcast, pack_bucket([torch.full((128,), 0.5)]), 0, TIMEOUT_S)
        assert (await asyncio.wait_for(accepted, TIMEOUT_S))["success"] is True
        assert await c.end_weight_update() is True
        with pytest.raises(EngineHTTPError) as err:
            await c.end_weight_update()
        assert err.value.status == 400 and "no weight-update session" in err.value.message
        assert await c.weight_version() == 41


async def test_releases_before_0_5_21_have_no_sessions(old):
    async with old.client() as c:
        assert await c.begin_weight_update() is False and await c.end_weight_update() is False
    async with aiohttp.ClientSession() as s, s.post(old.url + "/begin_weight_update", json={}) as r:
        assert r.status == 404
    async with joined(old, 1) as (c, group):
        accepted = update(c, [NORM], ["float32"], [[128]], weight_version=18)
        await asyncio.to_thread(group.broadcast, pack_bucket([torch.full((128,), 0.25)]), 0, TIMEOUT_S)
        assert (await asyncio.wait_for(accepted, TIMEOUT_S))["success"] is True


async def test_an_unaligned_bucket_is_refused_before_the_broadcast_from_0_5_23(new):
    async with joined(new, 2) as (c, group):
        await c.begin_weight_update()
        refused = update(c, ["a", "b"], ["bfloat16", "float32"], [[3], [2]])  # b would start at byte 6
        with pytest.raises(EngineHTTPError) as err:
            await asyncio.wait_for(refused, 10)
        assert "Unaligned received tensor b" in err.value.message


async def test_an_unaligned_bucket_fails_after_the_broadcast_before_0_5_23(old):
    async with joined(old, 1) as (c, group):
        refused = update(c, ["a", "b"], ["bfloat16", "float32"], [[3], [2]])
        await asyncio.sleep(0.5)  # not a wait for a state: room for a wrong engine to refuse before the broadcast
        assert not refused.done(), "0.5.18 enters the broadcast before it looks at the layout"
        await asyncio.to_thread(group.broadcast, torch.zeros(14, dtype=torch.uint8), 0, TIMEOUT_S)
        with pytest.raises(EngineHTTPError) as err:
            await asyncio.wait_for(refused, TIMEOUT_S)
        assert "partially updated" in err.value.message and "Unaligned" in err.value.message


async def test_a_paused_update_holds_continue_generation(new):
    """SGLang holds its pause condition for a whole update while paused: a continue waits."""
    async with joined(new, 2) as (c, group):
        await c.pause("abort")
        await c.begin_weight_update()
        pending = update(c, [NORM], ["float32"], [[128]])
        resume = asyncio.ensure_future(c.resume())
        await asyncio.sleep(0.5)  # not a wait for a state: room for a wrong implementation to resume early
        assert not resume.done() and not pending.done()
        await asyncio.to_thread(group.broadcast, pack_bucket([torch.ones(128)]), 0, TIMEOUT_S)
        await asyncio.wait_for(pending, TIMEOUT_S)
        await asyncio.wait_for(resume, TIMEOUT_S)
        info = (await c.server_info())["internal_states"][0]
        assert info["paused"] is False


async def test_an_update_that_cannot_flush_fails_from_0_5_22(new):
    """``flush_cache: true`` with requests still running (paused in place) fails the call after
    loading, as SGLang 0.5.22+ does (0.5.21 and older crash on an assert instead)."""
    async with joined(new, 2) as (c, group):
        long = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}, rid="busy-1"))
        await wait_for(lambda: _running(c), WAIT_S, "a running request")
        await c.pause("in_place")
        await c.begin_weight_update()
        call = asyncio.ensure_future(c.update_weights_from_distributed([NORM], ["float32"], [[128]], load_format="flattened_bucket",
                                                                       flush_cache=True, timeout_s=TIMEOUT_S))
        await asyncio.to_thread(group.broadcast, pack_bucket([torch.ones(128)]), 0, TIMEOUT_S)
        with pytest.raises(EngineHTTPError) as err:
            await asyncio.wait_for(call, TIMEOUT_S)
        assert "cache was not flushed" in err.value.message
        await c.abort(abort_all=True)
        await c.resume()
        assert (await asyncio.wait_for(long, TIMEOUT_S)).finish_reason.type == "abort"


async def test_a_flush_after_retract_works_from_0_5_21_and_fails_before(new, old):
    """A ``retract`` pause leaves the requests queued: 0.5.21+ flush anyway while paused (the
    queue is ignored), older releases answer 400 until the queue is empty."""
    for engine, ok in ((new, True), (old, False)):
        async with engine.client() as c:
            long = asyncio.ensure_future(c.generate(PROMPT, {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
                                                    rid=f"retract-flush-{ok}"))
            await wait_for(lambda c=c: _running(c), WAIT_S, "a running request")
            await c.pause("retract")
            try:
                assert (await c.loads())["loads"][0]["num_waiting_reqs"] == 1
                async with aiohttp.ClientSession() as s, s.get(f"{engine.url}/flush_cache") as r:
                    assert (r.status == 200) is ok, (engine.url, r.status)
            finally:
                await c.abort(abort_all=True)
                await c.resume()
            assert (await asyncio.wait_for(long, TIMEOUT_S)).finish_reason.type == "abort"


async def _running(c: EngineClient) -> bool:
    return (await c.loads())["loads"][0]["num_running_reqs"] > 0


async def test_health_waits_behind_a_pause(new, dp):
    async with new.client() as c:
        await c.pause("abort")
        try:
            started = time.monotonic()
            assert await c.health(timeout_s=30) is False  # SGLANG_HEALTH_CHECK_TIMEOUT=2
            assert time.monotonic() - started >= 1.9
            assert await c.alive(timeout_s=5) is True
            probe = asyncio.ensure_future(c.health_generate(timeout_s=30))
            # not a wait for a state: room for the probe to arrive while paused, where a wrong engine would
            # fail it (the engine shows no held probe to wait on; one that arrives after the resume passes too)
            await asyncio.sleep(0.2)
        finally:
            await c.resume()
        assert await asyncio.wait_for(probe, 30) is True  # resumed within the window: healthy
    async with dp.client() as c:  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0: /health does not generate
        await c.pause("abort")
        try:
            assert await c.health(timeout_s=5) is True
        finally:
            await c.resume()


async def test_dp_layouts_are_refused_like_sglang_and_before_any_update(dp, old):
    async with dp.client() as c:
        with pytest.raises(EngineHTTPError) as err:
            await c.init_weights_update_group("127.0.0.1", 1, 1, 2, backend="gloo")
        assert err.value.status == 500 and "data-parallel" in err.value.message
    pub = DirectEnginePublisher([EngineClient(dp.url)], master_address="127.0.0.1", bucket_bytes=1 << 20,
                                group_timeout_s=10, broadcast_timeout_s=10, control_timeout_s=10)
    try:
        with pytest.raises(WeightSyncError) as err:
            await pub.publish(1, {NORM: torch.ones(128)})
        assert f"engine {dp.url}: dp_size=2" in str(err.value) and "0.5.23" in str(err.value)
    finally:
        await pub.close()
    async with old.client() as c:  # 0.5.18 with dp attention: the replicas are the TP workers
        info = await c.server_info()
    assert info["dp_size"] == 2 and info["enable_dp_attention"] is True


async def test_the_products_sequence_updates_engines_of_both_releases_and_layouts(new, old, ref_model):
    """DirectEnginePublisher (the shared engine-side sequence): sessions where they exist, ranks
    from /server_info (tp 2 at offset 1, tp 1 at offset 3), byte buckets with mixed dtypes."""
    model = perturb(copy.deepcopy(ref_model), 3)
    weights = {k: (v.detach().to(torch.bfloat16) if i % 3 == 0 else v.detach()) for i, (k, v) in enumerate(model.state_dict().items())}
    pub = DirectEnginePublisher([EngineClient(new.url), EngineClient(old.url)], master_address="127.0.0.1",
                                bucket_bytes=256 * 1024, group_timeout_s=TIMEOUT_S, broadcast_timeout_s=TIMEOUT_S,
                                control_timeout_s=TIMEOUT_S)
    try:
        metrics = await pub.publish(7, weights)
        assert metrics["trainer/sync_buckets"] >= 3 and pub.offsets == [1, 3] and pub.group.world_size == 4
    finally:
        await pub.close()
    expected = copy.deepcopy(ref_model)
    with torch.no_grad():
        for name, t in expected.state_dict().items():
            t.copy_(weights[name].float())
    for engine in (new, old):
        async with engine.client() as c:
            res = await c.generate(PROMPT, GREEDY)
            lp = teacher_forced_logprobs(expected, PROMPT, res.output_ids)
            assert res.weight_version == 7 and max(abs(a - b) for a, b in zip(res.logprobs, lp)) < 1e-4
            assert (await c.server_info())["internal_states"][0]["weight_update_session"] is False
