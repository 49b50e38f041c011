"""An engine that stops answering while it generates (SIGSTOP, outside any sync): its calls
must not wait for their request timeout (minutes). The pool's health probe finds it
within seconds, every call of this service on it is taken back (aborted there by exact rid,
raised as EngineLost) and retried on the other engine, keeping the tokens of earlier turns;
nothing ends in error. After SIGCONT the engine answers its probes, is routed to again (a
call without affinity lands on it), serves, and the run ends healthy.
"""

from __future__ import annotations

import asyncio
import signal
import time

from rollout_service.engines.health import HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.run_health import wait_run_healthy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN, running_service, service_config

# a probe may have just started when the engine stopped: one interval, a /model_info timeout,
# one more interval for the check loop, and slack for a busy 2-core box
HANG_BOUND_S = 2 * HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S + 10.0


async def test_a_hung_engine_loses_its_calls_to_the_other_within_seconds(tmp_path, nats_server, warm_model):
    with (start_engine(tmp_path, model=str(warm_model), name="engine-a") as engine_a,
          start_engine(tmp_path, model=str(warm_model), name="engine-b") as engine_b):
        cfg = service_config(tmp_path, nats_server.url, [engine_a.url, engine_b.url], "rollout.total_rollout_steps=400",
                             "async_training.staleness_threshold=100", "run.progress_window_s=3")
        async with running_service(cfg) as (svc, url):
            ids = {e["url"]: e["id"] for e in svc.pool.snapshot()}
            a, b = svc.pool.engines[ids[engine_a.url]], svc.pool.engines[ids[engine_b.url]]
            await wait_for(lambda: a.tokens_decoded > 0 and b.inflight >= 1, 60, "both engines busy")
            engine_b.proc.signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                await wait_for(lambda: b.state == "unhealthy" and b.inflight == 0, HANG_BOUND_S,
                               "the hung engine out of rotation with nothing waiting on it")
                assert time.monotonic() - stopped_at < HANG_BOUND_S
                assert b.evicted >= 1 and b.reason.startswith("not answering"), (b.evicted, b.reason)
                routed, served = b.routed, b.served  # nothing in flight on b from here on
                decoded = a.tokens_decoded
                await wait_for(lambda: a.tokens_decoded > decoded + 50, 30, "the other engine carrying the rollout")
                health = svc.status().health
                assert health["state"] == "progressing", health
                assert [w["component"] for w in health["warnings"]] == [f"engine {b.id}"], health
            finally:
                engine_b.proc.signal(signal.SIGCONT)
            await wait_for(lambda: b.state == "healthy", 30, "the engine back after SIGCONT")
            # routed to again: a call without affinity goes to the less busy engine. Every agent now
            # has its affinity on `a` (new agents only start when old ones finish, which a loaded box
            # can delay past any bound), so the probe lands on `b` unless calls were already routed
            # there since the eviction (then b.inflight >= a.inflight > 0).
            probe = await svc.pool.generate(None, [5, 6, 7, 8], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
                                            f"{svc.runner.rid_prefix}probe-after-sigcont")
            assert len(probe.output_ids) == 8 and b.routed > routed
            await wait_for(lambda: b.served > served, 60, "the engine serving calls again")
            assert svc.runner.counters.finish_reasons.get("error", 0) == 0, svc.runner.counters.finish_reasons
            await wait_run_healthy(url, ADMIN, 30)


def test_call_timeout_is_derived_from_what_the_call_asks_for():
    from rollout_service.engines.pool import EnginePool

    pool = EnginePool(request_timeout_floor_s=60.0, min_decode_tokens_per_s=2.0)
    assert pool.call_timeout({"max_new_tokens": 512}) == 60.0 + 256.0
    assert pool.call_timeout({"max_new_tokens": 32768}) == 60.0 + 16384.0  # a long response is not cut at 10 minutes
    assert pool.call_timeout({}) == 60.5
    assert EnginePool(request_timeout_s=30.0).call_timeout({"max_new_tokens": 32768}) == 30.0  # an explicit bound wins


async def test_a_partial_pause_does_not_wait_on_a_hung_engine(tmp_path, nats_server, warm_model):
    """Issue 33 item 2: an engine that hangs (SIGSTOP) with calls in flight just as a sync
    pauses the rollout: the pause's exact aborts to it get no answer, and the pause must not wait
    the control timeout (60 s) for them. Its calls are taken back by the health check within
    seconds and the pause returns, bounded by the healthy engine, with nothing generating."""
    import aiohttp

    from tests.rollout.conftest import admin

    with (start_engine(tmp_path, model=str(warm_model), name="engine-a") as engine_a,
          start_engine(tmp_path, model=str(warm_model), name="engine-b") as engine_b):
        # B's generate calls are held at a proxy: they are in flight when B stops, whatever the
        # timing (found under load: B's last calls could finish just before the SIGSTOP)
        proxy = await RecordingProxy(engine_b.url).start()
        proxy.hold = asyncio.Event()
        cfg = service_config(tmp_path, nats_server.url, [engine_a.url, proxy.url], "rollout.total_rollout_steps=400",
                             "async_training.staleness_threshold=100", "async_training.partial_rollout=true")
        try:
            async with running_service(cfg) as (svc, url), aiohttp.ClientSession() as http:
                ids = {e["url"]: e["id"] for e in svc.pool.snapshot()}
                a, b = svc.pool.engines[ids[engine_a.url]], svc.pool.engines[ids[proxy.url]]
                await wait_for(lambda: a.inflight >= 1 and proxy.held >= 1 and b.inflight >= 1, 60, "both engines busy")
                engine_b.proc.signal(signal.SIGSTOP)
                try:
                    started = time.monotonic()
                    status, body = await admin(http, "POST", f"{url}/admin/pause", {"mode": "partial"})
                    took = time.monotonic() - started
                    assert status == 200 and body["counts"]["generating"] == 0, body
                    assert took < HANG_BOUND_S, f"the pause took {took:.0f} s: it waited on the hung engine"
                    assert b.state == "unhealthy" and b.inflight == 0
                finally:
                    engine_b.proc.signal(signal.SIGCONT)
                    proxy.hold.set()
                status, _ = await admin(http, "POST", f"{url}/admin/resume", {"version": 0})
                assert status == 200
        finally:
            proxy.hold.set()
            await proxy.stop()
