"""Issue 67 L4: a session joining an outside group is held to that group. Joins once skipped the
staleness quota, the pause and ``group_size`` (six sessions joined a size-1 group while the
service was paused with its quota used up), and two concurrent ``/finish`` calls of one session
both published it (its status was read before the session's lock), so its group left the
accounting a member early.

Driven through the HTTP API as a client would (``data.source = "sessions"``: the service starts
nothing of its own), against a real local engine."""

from __future__ import annotations

import asyncio

import httpx

from tests.rollout.conftest import ADMIN, running_service, service_config

API = "data-plane-token-0123456789"
HEADERS = {"Authorization": f"Bearer {API}"}


def _config(tmp_path, nats_url, engine, *extra: str):
    return service_config(tmp_path, nats_url, [engine], "data.source=sessions", f"security.api_token={API}",
                          "async_training.staleness_threshold=0", "rollout.n=2", *extra)


async def _session(http, url, group: str, size: int, index: int = 0) -> httpx.Response:
    return await http.post(f"{url}/v1/sessions", json={"group_id": group, "group_size": size, "group_index": index},
                           headers=HEADERS)


async def test_joins_are_held_to_the_group_size_and_the_pause(tmp_path, nats_server, warm_engine):
    async with running_service(_config(tmp_path, nats_server.url, warm_engine)) as (svc, url), \
            httpx.AsyncClient(timeout=60) as http:
        first = await _session(http, url, "solo", 1)
        assert first.status_code == 201, first.text
        for _ in range(3):  # a size-1 group has one place, however often it is asked
            extra = await _session(http, url, "solo", 1)
            assert extra.status_code == 409, extra.text
            assert "group 'solo' is full" in extra.json()["error"]["message"]
        assert svc.runner.groups["x:solo"] == 1

        pair = await _session(http, url, "pair", 2)
        assert pair.status_code == 201, pair.text
        paused = await http.post(f"{url}/admin/pause", json={"mode": "hold"}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert paused.status_code == 200, paused.text
        during = await _session(http, url, "pair", 2, 1)  # a place is left, but the service is paused
        assert during.status_code == 429 and "paused" in during.json()["error"]["message"], during.text
        assert during.headers["Retry-After"]
        resumed = await http.post(f"{url}/admin/resume", json={"version": 0}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert resumed.status_code == 200, resumed.text
        after = await _session(http, url, "pair", 2, 1)
        assert after.status_code == 201, after.text
        full = await _session(http, url, "pair", 2, 1)
        assert full.status_code == 409, full.text


async def test_two_concurrent_finishes_publish_a_session_once(tmp_path, nats_server, warm_engine):
    cfg = _config(tmp_path, nats_server.url, warm_engine, "rollout.publish_unit=group")  # held until the group is whole
    async with running_service(cfg) as (svc, url), \
            httpx.AsyncClient(timeout=60) as http:
        made = await _session(http, url, "q-1", 2)
        assert made.status_code == 201, made.text
        sid, token = made.json()["id"], made.json()["token"]
        auth = {"Authorization": f"Bearer {token}"}
        turn = await http.post(f"{url}/v1/sessions/{sid}/v1/completions", headers=auth,
                               json={"prompt": [5, 17, 42], "max_tokens": 4})
        assert turn.status_code == 200, turn.text
        before = svc.runner.groups["x:q-1"]
        answers = await asyncio.gather(*(http.post(f"{url}/v1/sessions/{sid}/finish", headers=auth, json={})
                                         for _ in range(2)))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert {a.json()["status"] for a in answers} == {"finished"}
        # one member finished, one still to come: the group is still accounted for, its one
        # trajectory held for the other (publish_unit = group)
        assert svc.runner.groups["x:q-1"] == before - 1 == 1
        assert [len(ids) for ids in svc.runner.outbox.held_ids().values()] == [1]
