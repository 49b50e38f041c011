"""The weight sync against engines that behave like SGLang (issue: real SGLang fidelity).

- An engine that refuses a bucket (SGLang answers at once and never joins the broadcast)
  stops the trainer's broadcast within the watcher's interval, not at its timeout; every
  member that did not confirm every bucket is quarantined before the rollout resumes, then
  reloaded and released; the next sync goes through.
- Engines whose ``/health`` waits behind the pause (``SGLANG_HEALTH_CHECK_TIMEOUT=2`` here,
  20 s on SGLang) stay healthy through a sync that keeps them paused longer than that.
- The agent refuses, before touching any engine, a layout SGLang cannot update and an NCCL
  group whose members cannot match.
- A group member that never joins shows at group formation, naming the engine.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch
from aiohttp import web

from asyncrl.engine_client import EngineClient
from asyncrl.launch import free_port
from asyncrl.models import load_model
from asyncrl.sync_control.errors import WeightSyncError
from tests.helpers.processes import Engine, start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import wait_for
from tests.sync.conftest import SYNC_TOKEN, perturbed_weights, publisher, stack
from tests.sync.test_sync_agent import engine_logprobs, model_logprobs
from trainer_daemon.sync.direct import DirectEnginePublisher

AUTH = {"Authorization": f"Bearer {SYNC_TOKEN}"}


def gated_link(monkeypatch, gate: asyncio.Event, before_bucket: int, sent: list[int]) -> None:
    """The trainer waits for ``gate`` before broadcasting bucket ``before_bucket``."""
    import trainer_daemon.sync.agent as trainer_side

    real = trainer_side.send_buckets

    async def gated(buckets, weights, buffers, send):
        async def gated_send(i, bucket, flat):
            if i == before_bucket:
                await gate.wait()
            await send(i, bucket, flat)
            sent.append(i)
        return await real(buckets, weights, buffers, gated_send)

    monkeypatch.setattr(trainer_side, "send_buckets", gated)


@pytest.fixture
def engines_with_short_health_window(tmp_path) -> list[Engine]:
    started: list[Engine] = []
    try:
        for i in range(2):
            started.append(start_engine(tmp_path, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}, name=f"engine-{i}"))
        yield started
    finally:
        for engine in started:
            engine.stop()


async def test_a_refused_bucket_stops_the_broadcast_at_once_and_quarantines_the_mixed_engines(tmp_path, nats_server, engines, monkeypatch):
    """Engine B (behind a proxy) answers bucket 3 the way SGLang refuses a bucket — 400 at once,
    without joining the broadcast — while staying in the group: the trainer's collective would
    wait for B until its 120 s timeout; the agent's verdict must stop it within seconds."""
    url_a, url_b = (e.url for e in engines)
    reload_dir = tmp_path / "initial"
    original = load_model("builtin:tiny")
    original.save_pretrained(reload_dir, safe_serialization=True)
    proxy = await RecordingProxy(url_b).start()
    calls = []

    def refuse_bucket_3(method, path, body):
        if path == "/update_weights_from_distributed":
            calls.append(body["names"])
            if len(calls) == 4:
                return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                          "begin_weight_update() and end_weight_update()"}
        return None

    proxy.intercept = refuse_bucket_3
    extra = ("sync.broadcast_timeout_s=120", f"sync.reload_path={reload_dir}")
    try:
        async with stack(tmp_path, nats_server.url, [url_a, proxy.url], *extra) as (svc, rollout_url, agent, agent_url, cfg):
            pub = publisher(agent_url, cfg, bucket_bytes=64 * 1024)
            try:
                _, weights = perturbed_weights(1)
                started = time.monotonic()
                with pytest.raises(WeightSyncError, match="the sync agent stopped the sync"):
                    await asyncio.wait_for(pub.publish(1, weights), 100)
                assert time.monotonic() - started < 60, "stopped by the agent's verdict, not by the 120 s broadcast timeout"
                rec = agent.coordinator.records[-1]
                await wait_for(lambda: rec.done, 60, "the failed sync to finish")
                assert rec.state == "failed" and "must run between begin_weight_update()" in rec.error
                assert set(rec.engines.values()) == {"mixed"}, rec.engines  # both hold buckets 0-2 of the new version
                assert not svc.runner.paused and svc.runner.version == 0
                # both were quarantined before the rollout resumed; reconcile reloads and releases them
                await wait_for(lambda: all(e["state"] == "healthy" for e in svc.pool.snapshot()), 60, "engines reloaded and released")
                for url in (url_a, url_b):
                    ids, lps, wv = await engine_logprobs(url)
                    assert wv == 0 and max(abs(a - b) for a, b in zip(lps, model_logprobs(original, ids))) < 1e-4
                model2, weights2 = perturbed_weights(2)
                await pub.publish(1, weights2)  # a new group (the agent dropped the old one)
                await wait_for(lambda: agent.coordinator.records[-1].done, 60, "the next sync")
                assert agent.coordinator.records[-1].state == "succeeded", agent.coordinator.records[-1].error
                ids, lps, wv = await engine_logprobs(url_b)
                assert wv == 1 and max(abs(a - b) for a, b in zip(lps, model_logprobs(model2, ids))) < 1e-4
            finally:
                await pub.close()
    finally:
        await proxy.stop()


async def test_engines_stay_routable_through_a_sync_longer_than_their_health_window(tmp_path, nats_server, engines_with_short_health_window, monkeypatch):
    urls = [e.url for e in engines_with_short_health_window]
    gate, sent = asyncio.Event(), []
    gated_link(monkeypatch, gate, 1, sent)
    async with stack(tmp_path, nats_server.url, urls) as (svc, rollout_url, agent, agent_url, cfg):
        pub = publisher(agent_url, cfg, bucket_bytes=256 * 1024)
        try:
            _, weights = perturbed_weights(1)
            publish = asyncio.create_task(pub.publish(1, weights))
            await wait_for(lambda: len(sent) == 1, 60, "the engines paused in the middle of the sync")
            checks = [h.last_checked for h in svc.pool.engines.values()]
            # at least two health rounds, each longer than the engines' 2 s window, while paused
            await wait_for(lambda: all(h.last_checked > c + 4.5 for h, c in zip(svc.pool.engines.values(), checks)), 60,
                           "health probes during the pause")
            assert all(h.state == "healthy" for h in svc.pool.engines.values()), svc.pool.snapshot()
            async with EngineClient(urls[0]) as c:  # really paused: the generation probe would have failed
                assert await c.health_generate(timeout_s=30) is False
            gate.set()
            await asyncio.wait_for(publish, 60)
            rec = agent.coordinator.records[-1]
            await wait_for(lambda: rec.done, 60, "the sync")
            assert rec.state == "succeeded", rec.error
            assert all(h.state == "healthy" for h in svc.pool.engines.values())
        finally:
            gate.set()
            await pub.close()


async def test_the_agent_refuses_layouts_and_nccl_groups_that_cannot_work(tmp_path, nats_server, engines):
    urls = [e.url for e in engines]
    with start_engine(tmp_path, "--pp-size", "2", name="engine-pp") as pp:
        pp_url = pp.url
        body = {"version": 1, "group": {"master_address": "127.0.0.1", "master_port": 45557, "new": True},
                "buckets": [{"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[128]]}]}
        async with stack(tmp_path, nats_server.url, [*urls, pp_url]) as (svc, rollout_url, agent, agent_url, cfg):
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.post(f"{agent_url}/v1/syncs", json=body, headers=AUTH)
        assert r.status_code == 409 and r.json()["error"]["reason"] == "layout"
        assert f"{pp_url}" in r.json()["error"]["message"] or "pp_size=2" in r.json()["error"]["message"]
        nccl = {**body, "group": {**body["group"], "backend": "nccl", "nccl_version": "2.21.5", "torch_version": "2.13.0+cu124"}}
        async with stack(tmp_path / "b", nats_server.url, urls, "run.id=second") as (svc, rollout_url, agent, agent_url, cfg):
            async with httpx.AsyncClient(timeout=30) as http:
                r = await http.post(f"{agent_url}/v1/syncs", json=nccl, headers=AUTH)
            assert r.status_code == 409 and r.json()["error"]["reason"] == "nccl_mismatch"
            assert "runs sglang 0.5.23, which pins torch 2.14.1" in r.json()["error"]["message"]
            assert agent.coordinator.records == [] and not svc.runner.paused  # refused before touching anything


class SilentEngine:
    """An HTTP server that answers like an SGLang engine but never completes joining a group."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.joining = asyncio.Event()

    async def __aenter__(self) -> SilentEngine:
        async def ok(_):
            return web.json_response({"success": True, "message": "Success", "status": "ok"})

        async def info(_):
            return web.json_response({"tp_size": 1, "dp_size": 1, "pp_size": 1, "version": "0.5.23"})

        async def join(_):
            self.joining.set()
            await asyncio.sleep(3600)

        app = web.Application()
        for path in ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update",
                     "/destroy_weights_update_group"):
            app.router.add_post(path, ok)
        app.router.add_get("/server_info", info)
        app.router.add_post("/init_weights_update_group", join)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def test_a_member_that_never_joins_shows_at_group_formation(engines):
    url_a = engines[0].url
    async with SilentEngine() as silent:
        pub = DirectEnginePublisher([EngineClient(url_a), EngineClient(silent.url)], master_address="127.0.0.1",
                                    bucket_bytes=1 << 20, group_timeout_s=3, broadcast_timeout_s=120, control_timeout_s=10)
        try:
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as err:
                await pub.publish(1, {"model.norm.weight": torch.ones(128)})
            assert time.monotonic() - started < 60 and silent.joining.is_set()
            assert "group join failed" in str(err.value) and silent.url in str(err.value)
        finally:
            await pub.close()
    async with EngineClient(url_a) as a:  # nothing left behind on the engine that did join
        info = (await a.server_info())["internal_states"][0]
        assert info["weight_update_groups"] == [] and info["weight_update_session"] is False and info["paused"] is False
