"""A sync agent SIGKILLed in the middle of loading weights, then restarted.

At the kill the rollout service is paused, the engines are paused and part-way through a
bucketed update (some parameters new, some old, and nothing told them so). The restarted
agent must reconcile from its state file, the engines' ``/model_info`` and the rollout
service: roll the sync back, quarantine the possibly-mixed engines, resume the rollout at
the old version, and bring the engines back: reloaded from ``sync.reload_path`` before they
serve again; or, with nothing to reload from, by asking the trainer for a full push
(``/status`` ``push_wanted``) — the run must never sit with every engine out and no way back.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import httpx

from asyncrl.launch import ChildProcess, free_port, http_ok
from asyncrl.models import load_model
from tests.helpers.run_health import wait_rollout_health, wait_run_healthy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN, running_service
from tests.sync.conftest import SYNC_TOKEN, config, perturbed_weights, publisher
from tests.sync.test_sync_agent import engine_logprobs, model_logprobs

AUTH = {"Authorization": f"Bearer {SYNC_TOKEN}"}
WINDOW_S = 4.0  # run.progress_window_s: a stall is reported after this long without progress
F9_BOUND_S = 60.0  # RELIABILITY.md F9: progress again within 60 s of the agent's restart
KILL_AFTER_BUCKETS = 10  # of the ~46 (one per parameter): the engines hold part new, part old weights


def agent_process(tmp_path, name: str, port: int, overrides: list[str]) -> ChildProcess:
    return ChildProcess(name, [sys.executable, "-m", "launcher", "sync-agent", *overrides, "--port", str(port)],
                        tmp_path / f"{name}.log").start()


def agent_overrides(cfg0, nats_url: str, urls: list[str], rollout_url: str, *extra: str) -> list[str]:
    """``asyncrl sync-agent`` overrides for an agent process beside the in-process rollout service of ``cfg0``."""
    engine_urls = '["' + '","'.join(urls) + '"]'
    return [f"run.dir={cfg0.run_dir}", f"nats.url={nats_url}", f"engines.urls={engine_urls}", f"security.admin_token={ADMIN}",
            f"security.sync_token={SYNC_TOKEN}", "rollout.n=2", "actor.ppo_mini_batch_size=2", "sync.reconcile_interval_s=0.5",
            "sync.group_init_timeout_s=30", "sync.pause_timeout_s=30", f"sync.rollout_url={rollout_url}", *extra]


async def latest_sync(agent_url: str) -> dict | None:
    async with httpx.AsyncClient(timeout=5) as http:
        syncs = (await http.get(f"{agent_url}/v1/syncs", headers=AUTH)).json()["syncs"]
    return syncs[-1] if syncs else None


def slow_link(monkeypatch, delay_s: float) -> list[int]:
    """The trainer's broadcasts take ``delay_s`` longer each (a slow network), so that
    loading lasts long enough to kill the agent in the middle of it. Returns a one-element
    list counting the buckets the trainer has sent."""
    import trainer_daemon.sync.agent as trainer_side

    real = trainer_side.send_buckets
    sent = [0]

    async def slow(buckets, weights, buffers, send):
        async def slow_send(i, bucket, flat):
            await asyncio.sleep(delay_s)  # the slow link itself, not a wait
            await send(i, bucket, flat)
            sent[0] += 1
        return await real(buckets, weights, buffers, slow_send)

    monkeypatch.setattr(trainer_side, "send_buckets", slow)
    return sent


async def test_agent_killed_while_loading_rolls_back_and_never_serves_mixed_weights(tmp_path, nats_server, engines, monkeypatch):
    sent = slow_link(monkeypatch, 0.1)
    urls = [e.url for e in engines]
    reload_dir = tmp_path / "initial-weights"
    original = load_model("builtin:tiny")
    original.save_pretrained(reload_dir, safe_serialization=True)
    extra = ["sync.broadcast_timeout_s=5", f"sync.reload_path={reload_dir}"]
    cfg0 = config(tmp_path, nats_server.url, urls, *extra)
    async with running_service(cfg0) as (svc, rollout_url):
        port = free_port()
        agent_url = f"http://127.0.0.1:{port}"
        overrides = agent_overrides(cfg0, nats_server.url, urls, rollout_url, *extra)
        cfg = config(tmp_path, nats_server.url, urls, f"sync.rollout_url={rollout_url}", *extra)
        agent = agent_process(tmp_path, "agent-1", port, overrides)
        pub = publisher(agent_url, cfg, bucket_bytes=8 * 1024)  # one bucket per parameter
        restarted = None
        try:
            await asyncio.to_thread(agent.wait_ready, lambda: http_ok(f"{agent_url}/health"), 60)
            _, weights1 = perturbed_weights(1)
            publish = asyncio.create_task(pub.publish(1, weights1))
            await wait_for(lambda: latest_sync(agent_url), 30, "the sync to be accepted")
            loading = await wait_for(_state_is(agent_url, "loading"), 60, "the agent to start loading", interval_s=0.02)
            await wait_for(lambda: sent[0] >= KILL_AFTER_BUCKETS, 60, f"{KILL_AFTER_BUCKETS} buckets broadcast")
            agent.signal(signal.SIGKILL)
            try:
                await publish
            except Exception:  # noqa: BLE001 - the trainer's broadcast breaks when the agent dies
                pass
            assert svc.runner.paused, "the dead agent left the rollout paused"

            restarted = agent_process(tmp_path, "agent-2", port, overrides)
            await asyncio.to_thread(restarted.wait_ready, lambda: http_ok(f"{agent_url}/health"), 60)
            back_at = time.monotonic()
            await wait_for(lambda: _state_is(agent_url, "failed")(), 30, "the recovery")
            async with httpx.AsyncClient(timeout=5) as http:
                rec = (await http.get(f"{agent_url}/v1/syncs/{loading['id']}", headers=AUTH)).json()
            assert rec["state"] == "failed" and "restarted during loading" in rec["error"], rec
            assert not svc.runner.paused and svc.runner.version == 0, "resumed at the old version"
            # the members were quarantined before the rollout resumed, then reloaded and released
            await wait_for(lambda: all(e["state"] == "healthy" for e in svc.pool.snapshot()), 60, "engines reloaded and released")
            log = (tmp_path / "agent-2.log").read_text()
            assert log.count("reloaded from") == len(urls), log[-3000:]
            decoded = sum(e["tokens_decoded"] for e in svc.pool.snapshot())
            await wait_for(lambda: sum(e["tokens_decoded"] for e in svc.pool.snapshot()) > decoded + 50, 60,
                           "the rollout decoding again")
            recovered_s = time.monotonic() - back_at
            assert recovered_s < F9_BOUND_S, f"decoding again {recovered_s:.0f} s after the agent came back"
            await wait_run_healthy(rollout_url, ADMIN, 30, agent_url, SYNC_TOKEN)
            for url in urls:
                ids, lps, wv = await engine_logprobs(url)
                assert wv == 0
                assert max(abs(a - b) for a, b in zip(lps, model_logprobs(original, ids))) < 1e-4, "exactly the initial weights"
            # the trainer's next sync (a new group) goes through on the restarted agent
            pub2 = publisher(agent_url, cfg, bucket_bytes=512 * 1024)
            try:
                model2, weights2 = perturbed_weights(2)
                await pub2.publish(1, weights2)
                done = await wait_for(_state_in(agent_url, ("succeeded", "failed")), 60, "the next sync")
                assert done["state"] == "succeeded", done
            finally:
                await pub2.close()
            for url in urls:
                ids, lps, wv = await engine_logprobs(url)
                assert wv == 1 and max(abs(a - b) for a, b in zip(lps, model_logprobs(model2, ids))) < 1e-4
            rollout, _ = await wait_run_healthy(rollout_url, ADMIN, 60, agent_url, SYNC_TOKEN)
            assert rollout["version"] == 1
        finally:
            await pub.close()
            agent.stop()
            if restarted is not None:
                restarted.stop()


async def agent_status(agent_url: str) -> dict:
    async with httpx.AsyncClient(timeout=30) as http:
        return (await http.get(f"{agent_url}/status", headers=AUTH)).json()


async def test_agent_killed_while_loading_with_nothing_to_reload_from_asks_for_a_push(tmp_path, nats_server, engines, monkeypatch):
    sent = slow_link(monkeypatch, 0.1)
    urls = [e.url for e in engines]
    cfg0 = config(tmp_path, nats_server.url, urls, "sync.broadcast_timeout_s=5", f"run.progress_window_s={WINDOW_S}")
    async with running_service(cfg0) as (svc, rollout_url):
        port = free_port()
        agent_url = f"http://127.0.0.1:{port}"
        overrides = agent_overrides(cfg0, nats_server.url, urls, rollout_url, "sync.broadcast_timeout_s=5",
                                    f"run.progress_window_s={WINDOW_S}")
        cfg = config(tmp_path, nats_server.url, urls, f"sync.rollout_url={rollout_url}", "sync.broadcast_timeout_s=5")
        agent = agent_process(tmp_path, "agent-1", port, overrides)
        pub = publisher(agent_url, cfg, bucket_bytes=8 * 1024)
        restarted = None
        try:
            await asyncio.to_thread(agent.wait_ready, lambda: http_ok(f"{agent_url}/health"), 60)
            _, weights1 = perturbed_weights(1)
            publish = asyncio.create_task(pub.publish(1, weights1))
            await wait_for(_state_is(agent_url, "loading"), 60, "the agent to start loading", interval_s=0.02)
            await wait_for(lambda: sent[0] >= KILL_AFTER_BUCKETS, 60, f"{KILL_AFTER_BUCKETS} buckets broadcast")
            agent.signal(signal.SIGKILL)
            try:
                await publish
            except Exception:  # noqa: BLE001 - the trainer's broadcast breaks when the agent dies
                pass
            restarted = agent_process(tmp_path, "agent-2", port, overrides)
            await asyncio.to_thread(restarted.wait_ready, lambda: http_ok(f"{agent_url}/health"), 60)
            back_at = time.monotonic()
            await wait_for(lambda: _state_is(agent_url, "failed")(), 30, "the recovery")
            assert not svc.runner.paused, "the rollout is resumed whatever the engines' state"
            status = await wait_for(lambda: _push_wanted(agent_url), 30, "the agent to ask for the trainer's weights")
            assert sorted(status["needs_reload"]) == sorted(e["id"] for e in svc.pool.snapshot())
            assert all(e["state"] == "quarantined" for e in svc.pool.snapshot()), "mixed engines never serve"
            # both services say why nothing moves, and whom to look at
            assert status["health"]["state"] == "stalled" and status["health"]["stuck"][0]["component"] == "trainer", status
            rollout = await wait_rollout_health(rollout_url, ADMIN, ("stalled",), 30, "the rollout to report the stall")
            stuck = rollout["health"]["stuck"]
            assert stuck[0] == {"component": "engines", "reason": f"no routable engine: all {len(urls)} are out of rotation"}
            assert [s["component"] for s in stuck[1:]] == ["sync_agent"] * len(urls), stuck
            # the trainer (idle: no engine produces data) publishes as asked
            decoded = sum(e["tokens_decoded"] for e in svc.pool.snapshot())
            model2, weights2 = perturbed_weights(2)
            await pub.publish(1, weights2)
            done = await wait_for(_state_in(agent_url, ("succeeded", "failed")), 60, "the pushed sync")
            assert done["state"] == "succeeded", done
            await wait_for(lambda: all(e["state"] == "healthy" for e in svc.pool.snapshot()), 30, "engines released")
            await wait_for(lambda: sum(e["tokens_decoded"] for e in svc.pool.snapshot()) > decoded + 50, 60,
                           "the rollout decoding again")
            recovered_s = time.monotonic() - back_at
            assert recovered_s < F9_BOUND_S, f"decoding again {recovered_s:.0f} s after the agent came back"
            _, agent_doc = await wait_run_healthy(rollout_url, ADMIN, 30, agent_url, SYNC_TOKEN)
            assert agent_doc["version"] == 1
            for url in urls:
                ids, lps, wv = await engine_logprobs(url)
                assert wv == 1 and max(abs(a - b) for a, b in zip(lps, model_logprobs(model2, ids))) < 1e-4
        finally:
            await pub.close()
            agent.stop()
            if restarted is not None:
                restarted.stop()


async def _push_wanted(agent_url: str) -> dict | None:
    status = await agent_status(agent_url)
    return status if status.get("push_wanted") else None


def _state_is(agent_url: str, state: str):
    return _state_in(agent_url, (state,))


def _state_in(agent_url: str, states: tuple[str, ...]):
    async def check():
        rec = await latest_sync(agent_url)
        return rec if rec and rec["state"] in states else None
    return check
