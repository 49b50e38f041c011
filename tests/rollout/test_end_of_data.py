"""The rollout service's end-of-data message (rollout_service/publish/end_of_data.py): published
once the data is played out — after the last trajectory, never while a session is open — and
left out of the queue depth the service admits by."""

from __future__ import annotations

import asyncio
import json

import httpx

from asyncrl.jetstream import connect
from asyncrl.wire import NatsNames, is_end_of_data
from rollout_service.build import unconsumed_trajectories
from rollout_service.service import METRICS_INTERVAL_S
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import running_service, service_config

API = "data-plane-token-0123456789"


async def stream_messages(nats_url: str, run_id: str) -> list:
    nc = await connect(nats_url, "test-reader", persistent=False)
    try:
        sub = await nc.jetstream().pull_subscribe(NatsNames(run_id).trajectories, durable=None)
        out = []
        while True:
            try:
                out += await sub.fetch(50, timeout=1)
            except TimeoutError:
                return out
    finally:
        await nc.close()


async def test_end_of_data_follows_the_last_trajectory_and_waits_for_open_sessions(tmp_path, nats_server, warm_engine):
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1", "rollout.n=2",
                         "rollout.sampling.max_new_tokens=16", "async_training.staleness_threshold=50",
                         f"security.api_token={API}")
    async with running_service(cfg) as (svc, url), httpx.AsyncClient(timeout=60) as http:
        sess = (await http.post(f"{url}/v1/sessions", json={}, headers={"Authorization": f"Bearer {API}"})).json()
        await wait_for(lambda: svc.runner.publisher.stats.published >= 2 and not svc.runner.tasks, 180,
                       "the run's one sample, published")
        # two metric periods with the data played out but a session open: a wrong implementation would send now
        await asyncio.sleep(2 * METRICS_INTERVAL_S + 1)
        assert not svc.end_of_data.sent and svc.data_played_out() is False
        r = await http.post(f"{url}/v1/sessions/{sess['id']}/finish", json={"failure": "agent_crash"},
                            headers={"Authorization": f"Bearer {sess['token']}"})
        assert r.status_code == 200 and r.json()["status"] == "failed"
        await wait_for(lambda: svc.end_of_data.sent, 3 * METRICS_INTERVAL_S, "the end of data once the session closed")
        assert await unconsumed_trajectories(svc.nc.jetstream(), svc.names, svc.end_of_data) == 2  # the message is not a trajectory
    msgs = await stream_messages(nats_server.url, cfg.run.id)
    assert [is_end_of_data(m.headers) for m in msgs] == [False, False, True]
    assert json.loads(msgs[-1].data) == {"samples": 2, "trajectories": 2}  # the internal sample and the session's group
