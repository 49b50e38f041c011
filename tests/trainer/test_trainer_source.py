"""The JetStream side of consumption against a real nats-server, in-process: in-progress
heartbeats keep held messages from redelivery, and a recreated consumer starts at the cursor."""

from __future__ import annotations

import asyncio
import random

from asyncrl.jetstream import connect, ensure_stream
from asyncrl.wire import NatsNames, encode_trajectory
from tests.trainer.helpers import make_group
from trainer_daemon.consume import ConsumptionState, TrajectorySource
from trainer_daemon.ledger import Ledger

ACK_WAIT_S = 1.0  # short, so a missing heartbeat shows within the test
HEARTBEAT_S = 0.25


async def _setup(cfg):
    nc = await connect(cfg.nats.url, "test-source", persistent=False)
    js = nc.jetstream()
    await ensure_stream(js, cfg)
    return nc, js


async def _publish(js, cfg, trajs):
    for t in trajs:
        await js.publish(NatsNames(cfg.run.id).trajectories, encode_trajectory(t), headers={"Nats-Msg-Id": t.id})


async def _held_then_redelivered(cfg, heartbeat: bool) -> int:
    nc, js = await _setup(cfg)
    try:
        names = NatsNames(cfg.run.id)
        src = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=2, ack_wait_s=ACK_WAIT_S)
        await src.start(js)
        beats = asyncio.create_task(src.heartbeat_loop(HEARTBEAT_S)) if heartbeat else None  # as the daemon does
        group = make_group(random.Random(0), f"h{int(heartbeat)}", 2)
        await _publish(js, cfg, group[:1])  # half a group: held, waiting for its other member
        assert await src.next_batch(1, 0, None, wait_s=0.5) is None
        await asyncio.sleep(4 * ACK_WAIT_S)  # not a wait for a state: time itself is the input (ack_wait expiring)
        assert await src.next_batch(1, 0, None, wait_s=1.0) is None  # a pull: an expired message comes back now
        if beats:
            beats.cancel()
        info = await js.consumer_info(names.stream, names.trainer_consumer)
        await src.close()
        return int(info.num_redelivered)
    finally:
        await nc.close()


async def test_heartbeats_keep_held_messages_from_redelivery(run_config):
    assert await _held_then_redelivered(run_config, heartbeat=True) == 0


async def test_without_heartbeats_held_messages_are_redelivered(run_config):
    assert await _held_then_redelivered(run_config, heartbeat=False) >= 1


async def test_recreated_consumer_starts_after_the_cursor(run_config):
    nc, js = await _setup(run_config)
    try:
        names = NatsNames(run_config.run.id)
        rng = random.Random(1)
        first, second = make_group(rng, "one", 2), make_group(rng, "two", 2)
        await _publish(js, run_config, first + second)
        a = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=2)
        await a.start(js)
        batch = await a.next_batch(1, 0, None, wait_s=5.0)
        await a.commit(batch, 1, 0)
        state = a.state.state_dict()
        await a.close()
        restored = ConsumptionState()
        restored.load_state_dict(state)
        b = TrajectorySource(names, restored, Ledger(parent=1), required_trajectories=2)
        await b.start(js)
        again = await b.next_batch(1, 0, None, wait_s=5.0)
        assert [h.traj.id for h in again[0].kept] == [t.id for t in second]
        assert b.redelivered_skipped == 0  # the consumer started past everything resolved
        await b.close()
    finally:
        await nc.close()
