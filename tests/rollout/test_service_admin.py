"""Admin API: authentication, bad input, engines at run time, metrics, refusing weak tokens."""

from __future__ import annotations

import subprocess
import sys

import aiohttp
import pytest

from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN, admin, running_service, service_config

ROUTES = [("POST", "/admin/pause", {}), ("POST", "/admin/resume", {"version": 1}), ("GET", "/admin/status", None),
          ("POST", "/admin/engines", {"url": "http://127.0.0.1:9"}), ("DELETE", "/admin/engines/x", None),
          ("POST", "/admin/engines/x/quarantine", {}), ("DELETE", "/admin/engines/x/quarantine", None)]


@pytest.fixture
async def service(tmp_path, nats_server, warm_engine):
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=2", "security.api_token=data-plane-token-xyz",
                         'engines.allowed_hosts=["127.0.0.1"]')  # engines may be added on any local port
    async with running_service(cfg) as running:
        yield running


async def test_admin_routes_refuse_missing_wrong_and_data_plane_tokens(service):
    svc, url = service
    async with aiohttp.ClientSession() as http:
        for method, path, body in ROUTES:
            for token, expected in ((None, 401), ("wrong-token-123456", 403), ("data-plane-token-xyz", 403)):
                status, payload = await admin(http, method, url + path, body, token=token)
                assert status == expected, (method, path, token, status, payload)
                assert payload["error"]["code"] == expected and "token" in payload["error"]["message"].lower() or "Bearer" in payload["error"]["message"]
        assert not svc.runner.paused, "an unauthenticated pause must not pause"
        status, _ = await admin(http, "GET", f"{url}/admin/status")
        assert status == 200
        async with http.get(f"{url}/health") as resp:  # health needs no token
            assert resp.status == 200


BAD_INPUT = [
    ("POST", "/admin/resume", b"{not json", 400, "malformed JSON"),
    ("POST", "/admin/resume", b'{"version": "abc"}', 400, "version"),
    ("POST", "/admin/resume", b'{"version": -1}', 400, "version"),
    ("POST", "/admin/resume", b"{}", 400, "version"),
    ("POST", "/admin/pause", b'{"mode": "sideways"}', 400, "mode"),
    ("POST", "/admin/pause", b'{"timeout_s": 0}', 400, "timeout_s"),
    ("POST", "/admin/pause", b'{"bogus": 1}', 400, "bogus"),
    ("POST", "/admin/engines", b'{"url": "not a url"}', 400, "url"),
    # nothing answers there (the discard port): refused, not left waiting in the pool
    ("POST", "/admin/engines", b'{"url": "http://127.0.0.1:9"}', 409, "http://127.0.0.1:9 is not answering"),
    ("POST", "/admin/engines/e-nope/quarantine", b"{}", 404, "no engine"),
    ("POST", "/admin/resume", b'[1, 2]', 400, ""),
]


async def test_bad_admin_input_gets_a_json_4xx_never_500(service):
    """Each case against one service (every one is refused: none changes its state)."""
    svc, url = service
    async with aiohttp.ClientSession() as http:
        for method, path, raw, expected, fragment in BAD_INPUT:
            async with http.request(method, url + path, data=raw, headers={"Authorization": f"Bearer {ADMIN}",
                                                                           "Content-Type": "application/json"}) as resp:
                body = await resp.json(content_type=None)
                assert resp.status == expected, (path, raw, body)
                assert fragment in body["error"]["message"], (path, raw, body)
    assert not svc.runner.paused
    assert [h.url for h in svc.pool.engines.values()] == [svc.cfg.engines.urls[0].rstrip("/")]


async def test_resume_to_an_older_version_is_a_conflict(service, warm_engine, install_version):
    svc, url = service
    async with aiohttp.ClientSession() as http:
        # only to a version a completed sync installed: 2^63-1 once wedged every later sync (issue 67)
        for version in (3, 2**63 - 1):
            status, body = await admin(http, "POST", f"{url}/admin/resume", {"version": version})
            assert status == 409 and f"no engine serves version {version} (they answer [0])" in body["error"]["message"], body
        assert svc.runner.snapshot().version == 0
        await install_version(warm_engine, 3)
        assert (await admin(http, "POST", f"{url}/admin/resume", {"version": 3}))[0] == 200
        status, body = await admin(http, "POST", f"{url}/admin/resume", {"version": 2})
        assert status == 409 and "older" in body["error"]["message"]
        status, body = await admin(http, "POST", f"{url}/admin/resume", {"version": 3})  # idempotent
        assert status == 200 and body["version"] == 3


async def test_engines_added_quarantined_released_and_removed_at_run_time(tmp_path, nats_server, warm_engine):
    from tests.helpers.processes import start_engine

    with start_engine(tmp_path, name="second-engine") as engine:
        second = engine.url
        cfg = service_config(tmp_path, nats_server.url, [warm_engine], "async_training.staleness_threshold=100",
                             f'engines.allowed_hosts=["127.0.0.1:{engine.port}"]')  # as an operator allows the one it adds
        async with running_service(cfg) as (svc, url), aiohttp.ClientSession() as http:
            status, body = await admin(http, "POST", f"{url}/admin/engines", {"url": second, "id": "second"})
            assert status == 200 and {e["id"] for e in body["engines"]} >= {"second"}
            first_id = next(e["id"] for e in body["engines"] if e["id"] != "second")
            status, body = await admin(http, "POST", f"{url}/admin/engines/{first_id}/quarantine", {"reason": "mixed weights"})
            states = {e["id"]: e["state"] for e in body["engines"]}
            assert states == {first_id: "quarantined", "second": "healthy"}
            assert [h.id for h in svc.pool.routable()] == ["second"]
            routed_before = svc.pool.engines[first_id].routed
            await wait_for(lambda: svc.pool.engines["second"].routed > 3, 60, "traffic on the second engine")
            assert svc.pool.engines[first_id].routed == routed_before, "a quarantined engine gets no new traffic"
            await svc.pool.check_once()  # a health check must not release a quarantine
            assert svc.pool.engines[first_id].state == "quarantined"
            status, body = await admin(http, "DELETE", f"{url}/admin/engines/{first_id}/quarantine")
            assert status == 200 and {e["id"]: e["state"] for e in body["engines"]}[first_id] == "healthy"
            # adding again an engine the pool has is not a new registration: kept, even while it is down
            engine.stop()
            status, body = await admin(http, "POST", f"{url}/admin/engines", {"url": second, "id": "second"})
            assert status == 200 and "second" in {e["id"] for e in body["engines"]}, body
            status, body = await admin(http, "DELETE", f"{url}/admin/engines/second")
            assert status == 200 and [e["id"] for e in body["engines"]] == [first_id]
            status, body = await admin(http, "DELETE", f"{url}/admin/engines/second")  # idempotent
            assert status == 200


async def test_metrics_use_verl_names(service):
    svc, url = service
    await wait_for(lambda: svc.runner.counters.trajectories_finished >= 1, 120, "a finished trajectory")
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    for name in ("asyncrl_rollouter_idle_ratio", "asyncrl_rollouter_staleness_samples", "asyncrl_rollout_trajectories_finished_total",
                 "asyncrl_rollout_tool_calls_total", "asyncrl_rollout_queued_samples", "asyncrl_rollout_tokens_decoded_total"):
        assert name in text, name
    # operability: the run's NATS stores by size, and capacity lost to quarantined-but-current engines
    await wait_for(lambda: svc.cfg and svc.store_sizes, 30, "the NATS stores sampled")
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        lines = (await resp.text()).splitlines()
    stream = svc.names.stream
    assert any(line.startswith(f'asyncrl_nats_store_messages{{store="{stream}"}}') for line in lines), lines
    assert any(line.startswith(f'asyncrl_nats_store_bytes{{store="KV_{svc.names.agents_bucket}"}}') for line in lines)
    eid = next(iter(svc.pool.engines))
    assert f'asyncrl_rollout_engine_quarantined_current_seconds_total{{engine="{eid}"}} 0.0' in lines
    await wait_for(lambda: svc.runner.publisher.stats.published >= 1, 60, "a published trajectory")
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        lines = (await resp.text()).splitlines()
    for name in ("asyncrl_rollout_publish_request_seconds", "asyncrl_rollout_publish_delay_seconds",
                 "asyncrl_rollout_event_loop_lag_seconds"):
        count = next(float(line.split()[-1]) for line in lines if line.startswith(f"{name}_count"))
        assert count >= 1, (name, count)
        assert any(line.startswith(f'{name}_bucket{{le="0.001"}}') for line in lines)


def test_time_quarantined_at_the_current_version_is_counted():
    from rollout_service.engines.handle import EngineHandle

    h = EngineHandle(id="e", url="http://127.0.0.1:9", client=None)
    h.weight_version = 3
    h.account(100.0, 3)  # first sight: nothing to add
    h.set_state("quarantined", "sync failed")
    h.account(105.0, 3)  # quarantined at the current version for 5 s
    h.account(107.0, 4)  # the run moved on: the engine is behind, the wait is not wasted capacity
    h.weight_version = 4
    h.account(110.0, 4)
    h.set_state("healthy", None)
    h.account(120.0, 4)
    assert h.quarantined_current_s == 8.0


@pytest.mark.parametrize("extra,fragment", [([], "admin_token is empty"), (["security.admin_token=changeme"], "admin_token is empty"),
                                            (["security.admin_token=same-token-123456", "security.api_token=same-token-123456"], "must differ")])
def test_service_refuses_to_start_with_a_weak_admin_token(tmp_path, extra, fragment):
    out = subprocess.run([sys.executable, "-m", "launcher", "rollout", f"run.dir={tmp_path}", *extra],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr
