"""One credential, one scope (issue 30 item 4): an environment with its own token lists its
parked calls (and their session tokens) with that token only, never with the data-plane token
or another environment's; an outside session's group is namespaced apart from the service's
own groups, so it cannot join one (with a reward it chose) or release it early; a group's size
is fixed by its first session."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import running_service, service_config

API = "data-plane-token-0123456789"
ENV_A = "environment-a-token-0123456789"
ENV_B = "environment-b-token-0123456789"


def _tool(name: str, environment: str) -> dict:
    return {"name": name, "description": "d", "parameters": {"type": "object", "properties": {}}, "environment": environment}


async def test_environment_tokens_groups_and_sizes_are_scoped(tmp_path, nats_server, warm_engine):
    # the service's generate calls are held at a proxy: its first group stays open while the
    # test uses its id (found by CI: a group that had already finished was gone)
    proxy = await RecordingProxy(warm_engine).start()
    proxy.hold = asyncio.Event()
    try:
        await _scoped(tmp_path, nats_server, proxy)
    finally:
        proxy.hold.set()
        await proxy.stop()


async def _scoped(tmp_path, nats_server, proxy):
    tools = json.dumps([_tool("ask_a", "env-a"), _tool("ask_b", "env-b"), _tool("ask_c", "env-c")])
    tokens = json.dumps({"env-a": ENV_A, "env-b": ENV_B})
    cfg = service_config(tmp_path, nats_server.url, [proxy.url], "rollout.tools=[]", f"rollout.external_tools={tools}",
                         f"security.environment_tokens={tokens}", "rollout.total_rollout_steps=1",
                         "async_training.staleness_threshold=50", f"security.api_token={API}")
    async with running_service(cfg) as (svc, url), httpx.AsyncClient(timeout=60) as http:
        def calls(env: str, token: str | None):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return http.get(f"{url}/v1/environments/{env}/tool_calls", headers=headers)

        assert (await calls("env-a", ENV_A)).status_code == 200
        assert (await calls("env-b", ENV_B)).status_code == 200
        for env, token, status in [("env-a", ENV_B, 403), ("env-b", ENV_A, 403), ("env-a", API, 403), ("env-b", API, 403),
                                   ("env-a", None, 401)]:
            r = await calls(env, token)
            assert r.status_code == status and f"environment '{env}'" in r.json()["error"]["message"], (env, token, r.text)
        assert (await calls("env-c", API)).status_code == 200  # no token of its own: the data plane's (warned at start)

        api = {"Authorization": f"Bearer {API}"}
        await wait_for(lambda: proxy.held > 0, 60, "the service's first generate call (held)")
        internal = next(iter(svc.runner.groups))  # one of the service's own groups, e.g. s00000000
        s = await http.post(f"{url}/v1/sessions", json={"group_id": internal, "group_size": 2}, headers=api)
        assert s.status_code == 201 and s.json()["group_id"] == internal  # the client keeps its name ...
        assert svc.runner.groups[internal] == cfg.rollout.n and svc.runner.groups[f"x:{internal}"] == 2  # ... apart from ours
        got = await http.get(f"{url}/v1/sessions/{s.json()['id']}", headers={"Authorization": f"Bearer {s.json()['token']}"})
        assert got.json()["group_id"] == internal
        other = await http.post(f"{url}/v1/sessions", json={"group_id": internal, "group_size": 64, "group_index": 1}, headers=api)
        assert other.status_code == 409 and "fixed by its first session" in other.json()["error"]["message"], other.text
        same = await http.post(f"{url}/v1/sessions", json={"group_id": internal, "group_size": 2, "group_index": 1}, headers=api)
        assert same.status_code == 201, same.text
