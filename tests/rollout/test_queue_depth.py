"""The queue depth the staleness quota resets to (rollout_service/build.py,
``unconsumed_trajectories``), against a real nats-server and a pull consumer that acts as the
trainer's: verl's message-queue size, what the trainer has not taken yet. What the trainer
holds (fetched, not acknowledged: the part of a step it is still assembling) is trained without
any new sample and must not count; counting it kept the quota shut while the trainer waited for
the rest of its step, for good (found by tests/deploy/test_compose_run.py's crash test)."""

from __future__ import annotations

from asyncrl.jetstream import StreamSettings, connect, ensure_stream
from asyncrl.wire import NatsNames
from rollout_service.build import queue_depth, unconsumed_trajectories
from rollout_service.publish.end_of_data import EndOfDataNotice
from rollout_service.runner.quota import QueueDepth, StalenessQuota


async def test_what_the_trainer_holds_is_not_queued_and_does_not_hold_the_quota_shut(run_config, nats_server):
    names = NatsNames(run_config.run.id)
    nc = await connect(nats_server.url, "queue-depth-test", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(run_config))
        for i in range(8):
            await js.publish(names.trajectories, b"{}", headers={"Nats-Msg-Id": f"t{i}"})
        end_of_data = EndOfDataNotice(run_config.run.id, names.trajectories, js.publish)
        # no trainer consumer yet: everything stored is queued, nothing held
        assert await unconsumed_trajectories(js, names, end_of_data) == 8
        assert await queue_depth(js, names, end_of_data) == QueueDepth(8, 0)
        trainer = await js.pull_subscribe(names.trajectories, durable=names.trainer_consumer, stream=names.stream)
        held = await trainer.fetch(6, timeout=5)  # three quarters of a step, held and not acknowledged
        assert len(held) == 6
        info = await js.consumer_info(names.stream, names.trainer_consumer)
        assert (info.num_pending, info.num_ack_pending) == (2, 6)
        assert await unconsumed_trajectories(js, names, end_of_data) == 2
        assert await queue_depth(js, names, end_of_data) == QueueDepth(2, 6)  # what the starvation rule reads as held
        # the quota at a version change, samples of n = 2: the two undelivered trajectories are one
        # queued sample; with what the trainer holds counted it would be four, the whole quota
        quota = StalenessQuota(max_required_samples=4, max_queue_size=4)
        quota.on_version(1, in_flight_samples=0, queued_samples=-(-await unconsumed_trajectories(js, names, end_of_data) // 2))
        assert quota.blocked_reason(queued_samples=1) is None
        for msg in held:
            await msg.ack()
        await nc.flush()
        assert await unconsumed_trajectories(js, names, end_of_data) == 2
        assert await queue_depth(js, names, end_of_data) == QueueDepth(2, 0)
    finally:
        await nc.close()
