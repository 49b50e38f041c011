"""The trainer's version is the outcome of the sync, not the end of its broadcast (issue:
learning correctness). Every bucket reaches both engines, then one engine's
``/end_weight_update`` answers 500: the agent fails the sync after the broadcast returned.
Before, ``publish`` returned at the end of the broadcast and the trainer counted version 1 as
served; now it waits for the agent's final state and raises, so ``SyncController`` keeps the
old version (and the next sync retries the same number)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.sync_control.errors import WeightSyncError
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import wait_for
from tests.sync.conftest import perturbed_weights, publisher, stack


async def test_a_sync_failed_after_its_broadcast_is_a_failed_publish(tmp_path, nats_server, engines):
    from trainer_daemon.io_loop import IoLoop
    from trainer_daemon.sync.base import SyncController

    engine_a, engine_b = engines
    proxy = await RecordingProxy(engine_b.url).start()
    refusing = [True]
    proxy.intercept = lambda method, path, body: ((500, {"error": {"message": "injected: end failed"}})
                                                  if path == "/end_weight_update" and refusing[0] else None)
    try:
        async with stack(tmp_path, nats_server.url, [engine_a.url, proxy.url]) as (svc, _rollout_url, agent, agent_url, cfg):
            pub = publisher(agent_url, cfg, bucket_bytes=64 * 1024)
            try:
                _, weights1 = perturbed_weights(1)
                with pytest.raises(WeightSyncError, match="did not complete sync"):
                    await asyncio.wait_for(pub.publish(1, weights1), 120)
                rec = agent.coordinator.records[-1]
                assert rec.done and rec.state == "failed" and "end_weight_update" in (rec.error or ""), rec.error
                buckets = [r for r in proxy.requests if r[1] == "/update_weights_from_distributed"]
                assert buckets and len(buckets) == len(rec.buckets), "every bucket reached the engine: the broadcast completed"
                assert svc.runner.version == 0, "the rollout was not moved to a version the sync did not reach"
            finally:
                await pub.close()

            # the same through the trainer's controller: the failed outcome keeps the version
            refusing[0] = True
            io = IoLoop()
            try:
                ctl = SyncController(publisher(agent_url, cfg, bucket_bytes=64 * 1024), io, version=0)
                _, weights2 = perturbed_weights(2)
                ctl.start(weights2)
                assert await asyncio.to_thread(ctl.wait, 180)
                assert ctl.version == 0 and ctl.failures == 1 and ctl.outcomes == {1: False}
                assert ctl.last_failed, "the trainer asks sooner whether engines wait for a push (rank0.RETRY_CHECK_S)"
                refusing[0] = False
                for _attempt in range(3):  # the next sync points retry the same number (the first may only regroup)
                    await wait_for(lambda: agent.coordinator.running is None, 60, "the agent idle")
                    assert ctl.start(weights2) == 1
                    assert await asyncio.to_thread(ctl.wait, 180)
                    if ctl.version == 1:
                        break
                assert ctl.version == 1 and ctl.outcomes[1] is True and "timing_s/sync_outcome" in ctl.last, ctl.last
                assert not ctl.last_failed
                await asyncio.to_thread(io.run, ctl.publisher.close(), 30)
            finally:
                io.close()
    finally:
        await proxy.stop()
