"""Faults: NATS stopped and restarted mid-run (F1), the rollout service SIGKILLed mid-episode
and restarted (F5), the rollout service partitioned from NATS (F12) — every trajectory is
published exactly once either way, and the service is back within the stated bound."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from asyncrl.jsonl_log import BoundedJsonl
from asyncrl.launch import ChildProcess, free_port, http_ok
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.tcp_proxy import PartitionableTcpProxy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN, admin, running_service, service_config
from tests.rollout.test_service_episodes import fetch_all

F1_BOUND_S = 30.0  # RELIABILITY.md F1: publishing again within 30 s of NATS being back
F12_DRAIN_S = 60.0  # RELIABILITY.md F12: the outbox drains within 60 s of the link coming back
F5_BOUND_S = 30.0  # RELIABILITY.md F5: a restarted rollout service decoding again within 30 s


def outage_after_publishes(monkeypatch, nats_server, n: int) -> None:
    """NATS is SIGKILLed the moment the service's ``n``-th trajectory publish is acknowledged:
    mid-run whatever the pace (a fast run could otherwise publish everything before a test
    that watches from outside gets to kill it)."""
    import rollout_service.build as service

    real = service.TrajectoryPublisher

    class OutageAfter(real):
        def __init__(self, outbox, subject, publish, *rest) -> None:
            acks = [0]

            async def publish_then_outage(subject, payload, headers):
                ack = await publish(subject, payload, headers)
                acks[0] += 1
                if acks[0] == n:
                    nats_server.kill()
                return ack

            super().__init__(outbox, subject, publish_then_outage, *rest)

    monkeypatch.setattr(service, "TrajectoryPublisher", OutageAfter)


async def test_nats_outage_mid_run_loses_and_duplicates_nothing(tmp_path, nats_server, warm_engine, monkeypatch):
    samples, n = 6, 2
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], f"rollout.n={n}", f"rollout.total_rollout_steps={samples}",
                         "async_training.staleness_threshold=10")
    outage_after_publishes(monkeypatch, nats_server, 2)
    async with running_service(cfg) as (svc, _url):
        await wait_for(lambda: svc.runner.publisher.stats.published >= 2, 120, "first publishes (then NATS is killed)")
        await wait_for(lambda: svc.runner.counters.trajectories_finished >= 6, 120, "trajectories finishing during the outage")
        retries = svc.runner.publisher.stats.retries
        await wait_for(lambda: svc.runner.publisher.stats.retries > retries, 60, "a publish attempt to fail and be retried")
        assert len(svc.runner.outbox) > 0, "finished trajectories wait in the outbox while NATS is down"
        # An acknowledgement counts, new or duplicate: a publish that NATS stored just before it
        # was killed comes back as a duplicate when retried, and when every trajectory waiting
        # was such a one, only duplicates are acknowledged until the next trajectory finishes
        stats = svc.runner.publisher.stats
        acked = stats.published + stats.duplicates
        nats_server.start()
        up_at = time.monotonic()
        await wait_for(lambda: stats.published + stats.duplicates > acked, F1_BOUND_S, "publishing again after NATS is up")
        assert time.monotonic() - up_at < F1_BOUND_S
        await wait_for(lambda: svc.runner.counters.trajectories_finished == samples * n, 180, "all trajectories finished")
        await wait_for(lambda: svc.runner.publisher.pending == 0 and len(svc.runner.outbox) == 0, 120, "outbox drained")
        assert svc.runner.publisher.stats.retries > 0
        await wait_for(lambda: svc.runner.agent_store.pending == 0, 30, "checkpoint deletes retried")
        status = svc.status()
        assert status.health["state"] in ("progressing", "finished") and not status.health["warnings"], status.health
        assert not status.paused and status.admission_blocked == "prompt stream exhausted"
    trajs = await fetch_all(nats_server.url, cfg.run.id, samples * n)
    ids = [t.id for t in trajs]
    assert len(ids) == samples * n and len(set(ids)) == samples * n
    assert {t.group_id for t in trajs} == {f"s{i:08d}" for i in range(samples)}


def _rollout_process(cfg_path, log, port) -> ChildProcess:
    return ChildProcess("rollout", [sys.executable, "-m", "launcher", "rollout", str(cfg_path), f"rollout.port={port}"], log).start()


async def _status(http, url):
    try:
        return (await admin(http, "GET", f"{url}/admin/status"))[1]
    except aiohttp.ClientError:
        return None


async def test_sigkill_mid_episode_then_restart_publishes_each_trajectory_once(tmp_path, nats_server, warm_engine):
    samples, n = 8, 2
    # The engine sits behind a proxy that holds every generation except the first sample's: that
    # sample finishes and is published, the other agents are mid-episode (checkpointed, not
    # finished) when the service is killed — however fast the engine is.
    proxy = await RecordingProxy(warm_engine).start()
    proxy.hold = asyncio.Event()
    proxy.hold_if = lambda body: ".demo-s00000000-" not in str(body.get("rid"))
    cfg_path = tmp_path / "rollout.json"
    cfg_path.write_text(json.dumps({
        "run": {"dir": str(tmp_path / "run")}, "nats": {"url": nats_server.url}, "engines": {"urls": [proxy.url]},
        "security": {"admin_token": ADMIN}, "rollout": {"n": n, "total_rollout_steps": samples},
        "actor": {"ppo_mini_batch_size": 2}, "async_training": {"staleness_threshold": 10},
    }))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        first = _rollout_process(cfg_path, tmp_path / "rollout-1.log", port)
        async with aiohttp.ClientSession() as http:
            try:
                await asyncio.to_thread(first.wait_ready, lambda: http_ok(f"{url}/health"), 120)

                async def mid_episode():
                    s = await _status(http, url)
                    return s and s["counts"]["active"] >= 2 and s["counters"]["trajectories_finished"] >= 2 and proxy.held >= 2

                await wait_for(mid_episode, 120, "agents mid-episode")
                first.kill()  # SIGKILL: no shutdown code runs
            finally:
                first.kill()
            second = _rollout_process(cfg_path, tmp_path / "rollout-2.log", port)
            try:
                await asyncio.to_thread(second.wait_ready, lambda: http_ok(f"{url}/health"), 120)
                status = await _status(http, url)
                assert status["counters"]["restored_agents"] + status["counters"]["dropped_already_finished"] >= 2
                proxy.hold.set()  # the dead service's held requests are dropped, the new ones go through
                ready_at, decoded = time.monotonic(), status["tokens"]["decoded"]

                async def decoding():
                    s = await _status(http, url)
                    return s and s["tokens"]["decoded"] > decoded

                await wait_for(decoding, F5_BOUND_S, "the restarted service decoding")
                assert time.monotonic() - ready_at < F5_BOUND_S

                async def done():
                    s = await _status(http, url)
                    return s and s["prompts"]["produced"] == samples and s["counts"]["active"] == 0 and s["counts"]["outbox"] == 0

                await wait_for(done, 240, "the restarted service to finish every sample")
                status = await _status(http, url)
                assert status["health"]["state"] in ("progressing", "finished") and not status["health"]["warnings"]
                assert not status["paused"] and all(e["state"] == "healthy" for e in status["engines"])
            finally:
                second.stop()
    finally:
        proxy.hold.set()
        await proxy.stop()
    trajs = await fetch_all(nats_server.url, "demo", samples * n)
    ids = [t.id for t in trajs]
    assert len(ids) == samples * n, f"expected {samples * n} trajectories, got {len(ids)}"
    assert len(set(ids)) == len(ids), "a trajectory was published twice"
    assert {t.group_id for t in trajs} == {f"s{i:08d}" for i in range(samples)}
    # the service's durable record of what it published spans both processes
    record = BoundedJsonl(tmp_path / "run" / "rollout" / "published.jsonl", 2**20).read()
    seqs: dict[str, set[int]] = {}
    for r in record:
        seqs.setdefault(r["id"], set()).add(r["seq"])
    assert set(seqs) == set(ids), "the published record misses (or invents) a trajectory"
    assert all(len(s) == 1 for s in seqs.values()) and len({next(iter(s)) for s in seqs.values()}) == len(ids)


async def test_partition_from_nats_caps_the_outbox_refuses_with_503_and_drains(tmp_path, nats_server, warm_engine):
    """F12 (RELIABILITY.md): the rollout service cut off from NATS (a partition, not a crash).
    Finished trajectories wait in the disk outbox up to ``rollout.outbox_max_items``; then
    admission stops, a new session is refused with 503 + Retry-After, and the health block
    names NATS. Once the link is back the outbox drains within 60 s and every trajectory is
    in the stream exactly once (replayed publishes deduplicated)."""
    samples, n, cap = 24, 2, 4  # more samples than finish during the cut: admission is stopped by the cap, not the stream
    proxy = PartitionableTcpProxy.for_url(nats_server.url).start()
    cfg = service_config(tmp_path, proxy.url(), [warm_engine], f"rollout.n={n}", f"rollout.total_rollout_steps={samples}",
                         "async_training.staleness_threshold=100", f"rollout.outbox_max_items={cap}", "run.progress_window_s=3")
    try:
        async with running_service(cfg) as (svc, url), aiohttp.ClientSession() as http:
            await wait_for(lambda: svc.runner.publisher.stats.published >= 2, 120, "first publishes")
            proxy.partition()
            # a publish fails first: acknowledgements already on their way when the link was cut
            # are consumed by then (the likely way a session was once admitted between the two checks below)
            await wait_for(lambda: svc.runner.publisher.stats.last_error, 60, "a publish to fail")
            await wait_for(lambda: (svc.status().admission_blocked or "").startswith("outbox full"), 120,
                           "admission stopped by the outbox cap")
            assert len(svc.runner.outbox) >= cap
            async with http.post(f"{url}/v1/sessions", json={}) as resp:
                body = await resp.json()
                assert resp.status == 503 and resp.headers["Retry-After"] == "5", body
                assert "outbox full" in body["error"]["message"], body
            status = await wait_for(lambda: (s := svc.status()).health["state"] == "stalled" and s, 60,
                                    "the health block to report the stall")
            assert "nats" in [x["component"] for x in status.health["stuck"]], status.health
            proxy.heal()
            healed_at = time.monotonic()
            await wait_for(lambda: len(svc.runner.outbox) == 0 and svc.runner.publisher.pending == 0, F12_DRAIN_S,
                           "the outbox drained after the partition")
            assert time.monotonic() - healed_at < F12_DRAIN_S
            await wait_for(lambda: svc.runner.counters.trajectories_finished == samples * n and len(svc.runner.outbox) == 0,
                           180, "every trajectory finished and published")
            assert not svc.status().health["warnings"]
    finally:
        proxy.stop()
    trajs = await fetch_all(nats_server.url, cfg.run.id, samples * n)
    ids = [t.id for t in trajs]
    assert len(ids) == samples * n and len(set(ids)) == samples * n
