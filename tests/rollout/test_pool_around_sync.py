"""The engine pool around a weight sync. What ``/admin/status`` shows as each engine's
``weight_version``: the newest-asked answer wins, and a sync's resume or release reads the
engines at once (found in CI: an engine kept showing the version before a sync because a busy
health check and no finished call had read it since). And a pause sends the calls that wait
for a routable engine back to the gate at once.
"""

from __future__ import annotations

import aiohttp

import rollout_service.engines.health as health_module
import rollout_service.engines.pool as pool_module
from asyncrl.engine_client import EngineClient
from rollout_service.engines.handle import EngineHandle
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import admin, running_service, service_config


def test_an_answer_to_an_older_request_does_not_take_the_version_back():
    h = EngineHandle(id="e", url="http://127.0.0.1:9", client=None)
    h.observe_version(3, asked_at=10.0)
    h.observe_version(4, asked_at=20.0)  # read after the sync
    h.observe_version(3, asked_at=15.0)  # a call sent before the sync, answered after the read
    assert h.weight_version == 4
    h.observe_version(None, asked_at=30.0)  # an answer without a version says nothing
    assert h.weight_version == 4
    h.observe_version(0, asked_at=30.0)  # a newer answer wins, whatever it says (a restarted engine: "default")
    assert h.weight_version == 0


async def test_resume_and_release_show_the_engines_new_version_without_waiting_for_a_health_check(
        tmp_path, nats_server, warm_engine, monkeypatch):
    # no health check after the first one, and no generation once the data is played out:
    # only the resume's and the release's reads can show the new version
    monkeypatch.setattr(health_module, "HEALTH_INTERVAL_S", 600.0)
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.n=2", "rollout.total_rollout_steps=1",
                         "rollout.sampling.max_new_tokens=8")
    async with running_service(cfg) as (svc, url), aiohttp.ClientSession() as http, EngineClient(warm_engine) as engine:
        await wait_for(lambda: svc.runner.counters.trajectories_finished >= 2 and svc.runner.snapshot().generating == 0, 120,
                       "the data played out")
        (handle,) = svc.pool.engines.values()
        before = handle.weight_version
        assert before is not None

        status, _ = await admin(http, "POST", f"{url}/admin/pause", {"mode": "partial"})
        assert status == 200
        await engine.update_weight_version(11)
        status, _ = await admin(http, "POST", f"{url}/admin/resume", {"version": 11})
        assert status == 200
        await wait_for(lambda: handle.weight_version == 11, 10, "the resumed engine's version shown")

        status, _ = await admin(http, "POST", f"{url}/admin/engines/{handle.id}/quarantine", {"reason": "test"})
        assert status == 200
        await engine.update_weight_version(12)
        status, body = await admin(http, "DELETE", f"{url}/admin/engines/{handle.id}/quarantine")
        assert status == 200
        await wait_for(lambda: handle.weight_version == 12, 10, "the released engine's version shown")
        status, body = await admin(http, "GET", f"{url}/admin/status")
        assert [e["weight_version"] for e in body["engines"]] == [12]


async def test_a_pause_sends_calls_waiting_for_a_routable_engine_back_at_once(monkeypatch):
    """Issue 33: after a failed sync every engine can be out of rotation; the agents' calls then
    wait in the router. The next sync's pause aborts this service's calls: those waiting must
    go back to the gate at that abort, not at their next periodic look (1 s per pause before)."""
    import asyncio

    from asyncrl.engine_client.errors import PausedWhileRouting
    from rollout_service.engines.pool import EnginePool

    monkeypatch.setattr(pool_module, "NO_ENGINE_RECHECK_S", 600.0)  # only a wake-up can end the wait
    from rollout_service.serving import ServingState

    serving = ServingState()
    pool = EnginePool(serving=serving)
    pool.add("http://127.0.0.1:9")
    (handle,) = pool.engines.values()
    pool.set_quarantine(handle.id, True, "sync-agent: mixed")
    waiting = asyncio.create_task(pool.generate(None, [1, 2], {}, rid="r-1"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    serving.pausing("partial")  # what the runner does at a partial pause
    serving.hold_calls()
    await pool.abort_inflight("r-")
    try:
        await asyncio.wait_for(waiting, 5)
        raise AssertionError("the call went on")
    except PausedWhileRouting:
        pass
    finally:
        await pool.close()


async def test_during_a_drain_pause_a_call_waiting_for_an_engine_keeps_waiting(monkeypatch):
    """A ``drain`` pause keeps the gate open for the trajectories it waits for. A call of theirs
    waiting for a routable engine must keep waiting here: sent back to the (open) gate it came
    straight back, raised again without ever yielding, and starved the event loop (a hang seen
    in CI: tests/rollout/test_service_pause.py's drain pause with every engine quarantined)."""
    import asyncio

    from rollout_service.engines.pool import EnginePool

    monkeypatch.setattr(pool_module, "NO_ENGINE_RECHECK_S", 600.0)
    from rollout_service.serving import ServingState

    serving = ServingState()
    serving.pausing("drain")  # a drain pause: paused, the gate still open for the trajectories it waits for
    pool = EnginePool(serving=serving)
    pool.add("http://127.0.0.1:9")
    (handle,) = pool.engines.values()
    pool.set_quarantine(handle.id, True, "test: no routable engine")
    waiting = asyncio.create_task(pool.generate(None, [1, 2], {}, rid="r-1"))
    try:
        await asyncio.sleep(0.05)
        await pool.abort_inflight("r-")  # the wake-up a pause sends
        await asyncio.sleep(0.05)
        assert not waiting.done(), "the call left the router although the gate does not hold it"
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await pool.close()
