"""The rollout admin messages (asyncrl/wire/rollout_admin.py): requests refuse what they do not
name, answers keep working when a newer server adds fields, and the sync agent's client turns
an answer that is not a status into its own error instead of a KeyError later."""

from __future__ import annotations

import pytest
from aiohttp import web
from pydantic import ValidationError

from asyncrl.launch import free_port
from asyncrl.wire.rollout_admin import EngineState, PauseRequest, QuarantineRequest, RolloutStatus
from sync_agent.rollout_admin import RolloutAdmin, RolloutAdminError

ENGINE = {"id": "e-1", "url": "http://127.0.0.1:1", "state": "quarantined", "reason": "sync-agent: x"}
STATUS = {"run_id": "demo", "version": 3, "paused": False, "uptime_s": 1.0, "health": {}, "quota": {}, "prompts": {},
          "tokens": {}, "rollouter": {}, "publisher": {}, "counters": {}, "tools": {}, "derived": {}, "engines": [ENGINE],
          "counts": {k: 0 for k in ("active", "parked", "sessions_open", "sessions_expired", "generating", "partial",
                                    "in_flight_samples", "queued_samples", "queued_trajectories", "stale", "outbox",
                                    "outbox_rejected")}}


def test_requests_refuse_unknown_fields_and_bad_values():
    with pytest.raises(ValidationError, match="timeout"):
        PauseRequest.model_validate({"mode": "partial", "timeout": 5})
    with pytest.raises(ValidationError):
        PauseRequest.model_validate({"mode": "abort"})  # an engine's mode, not the rollout's
    with pytest.raises(ValidationError):
        QuarantineRequest(reason="x" * 501)


def test_answers_ignore_fields_a_newer_server_adds():
    status = RolloutStatus.model_validate({**STATUS, "new_section": {"a": 1},
                                           "engines": [{**ENGINE, "new_gauge": 2.0}]})
    assert status.engine("e-1") == EngineState(**ENGINE) and status.engine("e-2") is None
    with pytest.raises(ValidationError):
        RolloutStatus.model_validate({**STATUS, "engines": [{**ENGINE, "state": "asleep"}]})


async def test_the_agents_client_sends_the_models_and_parses_the_answer():
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.path, await request.json() if request.can_read_body else None))
        if request.path == "/admin/resume":
            return web.json_response({"run_id": "demo"})  # not a status
        return web.json_response(STATUS)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = RolloutAdmin(f"http://127.0.0.1:{port}", "token", timeout_s=5)
    try:
        paused = await client.pause("partial", 7.0)
        assert paused.engines[0].state == "quarantined" and paused.version == 3
        await client.quarantine("e-1", "r" * 600)
        with pytest.raises(RolloutAdminError, match="not a rollout status"):
            await client.resume(4)
        assert seen[0] == ("POST", "/admin/pause", {"mode": "partial", "timeout_s": 7.0, "version": None})
        assert seen[1] == ("POST", "/admin/engines/e-1/quarantine", {"reason": "r" * 500})
        assert seen[2] == ("POST", "/admin/resume", {"version": 4})
    finally:
        await client.close()
        await runner.cleanup()
