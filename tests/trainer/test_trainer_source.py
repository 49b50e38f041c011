"""The JetStream side of consumption against a real nats-server, in-process: in-progress
heartbeats keep held messages from redelivery, a recreated consumer starts at the cursor, and
(issue 47) deliveries that went to another client of the consumer are read again, not skipped,
before the trainer may call the data ended."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncrl.jetstream import StreamSettings, connect, ensure_stream
from asyncrl.wire import NatsNames, encode_trajectory
from tests.trainer.helpers import make_group
from trainer_daemon.consume import ConsumptionState, TrajectorySource
from trainer_daemon.state.ledger import Ledger

ACK_WAIT_S = 1.0  # short, so a missing heartbeat shows within the test
HEARTBEAT_S = 0.25


async def _setup(cfg):
    nc = await connect(cfg.nats.url, "test-source", persistent=False)
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(cfg))
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


async def _publish_end(js, cfg, samples: int) -> int:
    from asyncrl.wire import end_of_data_message

    body, headers = end_of_data_message(cfg.run.id, samples, 0)
    return (await js.publish(NatsNames(cfg.run.id).trajectories, body, headers=headers)).seq


async def test_a_restored_source_reads_what_lies_before_the_end_of_data_before_calling_the_data_ended(run_config):
    """Issue 29: a checkpoint taken after the marker was read but before the trajectories ahead
    of it were trained. Restored, the trainer must not act on the marker before it has read
    them again (it used to stop at once, leaving them neither trained nor dropped)."""
    nc, js = await _setup(run_config)
    try:
        names = NatsNames(run_config.run.id)
        rng = random.Random(2)
        first, second = make_group(rng, "first", 2), make_group(rng, "second", 2)
        await _publish(js, run_config, first + second)
        end_seq = await _publish_end(js, run_config, 2)
        a = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=2)
        await a.start(js)
        batch = await a.next_batch(1, 0, None, wait_s=5.0)
        assert [h.traj.id for h in batch[0].kept] == [t.id for t in first]
        assert a.marker_read  # the one fetch read the marker too
        await a.commit(batch, 1, 0)
        state = a.state.state_dict()
        await a.close()
        assert [end_seq, "end", ""] in state["above"] and state["cursor"] < end_seq - 2  # "second" held, not resolved
        restored = ConsumptionState()
        restored.load_state_dict(state)
        b = TrajectorySource(names, restored, Ledger(parent=1), required_trajectories=2)
        await b.start(js)
        assert not b.data_ended  # the marker was read, but not what precedes it, in this incarnation
        with pytest.raises(RuntimeError):
            await b.take_rest(0, None)
        again = await b.next_batch(1, 0, None, wait_s=5.0)
        assert [h.traj.id for h in again[0].kept] == [t.id for t in second] and not again[0].incomplete
        await b.commit(again, 2, 0)
        assert await b.next_batch(1, 0, None, wait_s=0.5) is None
        assert b.data_ended and await b.take_rest(0, None) == [] and b.state.cursor == end_seq
        await b.close()
    finally:
        await nc.close()


async def test_after_the_end_of_data_the_groups_too_few_for_a_step_are_handed_over(run_config):
    nc, js = await _setup(run_config)
    try:
        names = NatsNames(run_config.run.id)
        rng = random.Random(3)
        whole, half = make_group(rng, "whole", 4), make_group(rng, "half", 4)[:2]
        await _publish(js, run_config, whole + half)
        src = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=12)
        await src.start(js)
        assert await src.next_batch(3, 0, None, wait_s=1.0) is None  # two groups can never make three
        assert not src.data_ended
        with pytest.raises(RuntimeError):
            await src.take_rest(0, None)
        await _publish_end(js, run_config, 2)
        assert await src.next_batch(3, 0, None, wait_s=2.0) is None
        assert src.data_ended
        rest = await src.take_rest(0, None)
        assert [[h.traj.id for h in g.kept] for g in rest] == [[t.id for t in whole], [t.id for t in half]]
        assert [g.incomplete for g in rest] == [False, True]
        await src.commit(rest, 1, 0)
        assert src.state.cursor == src.state.max_delivered and not src.state.held
        await src.close()
    finally:
        await nc.close()


async def _thief(cfg, batch: int):
    """Another client bound to the trainer's durable consumer that takes ``batch`` deliveries
    and never acks them: a trainer of the same run still alive, or the pull of a process that
    died. Returns its connection and the stream sequences it took."""
    nc = await connect(cfg.nats.url, "test-thief", persistent=False)
    names = NatsNames(cfg.run.id)
    sub = await nc.jetstream().pull_subscribe_bind(durable=names.trainer_consumer, stream=names.stream)
    taken = await sub.fetch(batch, timeout=5)
    return nc, [int(m.metadata.sequence.stream) for m in taken]


async def _drain(src, k: int, steps: int) -> list[list[str]]:
    """Train (commit) up to ``steps`` steps of ``k`` groups, then what ``take_rest`` hands over
    once the data ended; returns the ids trained per step."""
    trained = []
    for step in range(1, steps + 1):
        batch = await src.next_batch(k, 0, None, wait_s=3.0)
        if batch is None:
            if not src.data_ended:
                continue
            batch = await src.take_rest(0, None)
            if not batch:
                break
        await src.commit(batch, step, 0)
        trained.append([h.traj.id for g in batch for h in g.kept])
    return trained


async def test_deliveries_taken_by_another_client_are_read_again_not_skipped(run_config):
    """Issue 47: the first group's two deliveries go to another client (never acked; ack_wait
    is a minute, so they would come back only long after). The source sees the consumer's
    delivery sequence jump, recreates the consumer at its cursor and trains every group; it
    used to train the others, move its cursor past the first, call the data ended and stop."""
    nc, js = await _setup(run_config)
    thief = None
    try:
        names = NatsNames(run_config.run.id)
        rng = random.Random(4)
        groups = [make_group(rng, f"g{i}", 2) for i in range(3)]
        await _publish(js, run_config, [t for g in groups for t in g])
        end_seq = await _publish_end(js, run_config, 3)
        src = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=2, ack_wait_s=60.0)
        await src.start(js)
        thief, taken = await _thief(run_config, 2)
        assert len(taken) == 2  # the precondition: the first group went elsewhere
        trained = await _drain(src, 1, 6)
        assert sorted(sorted(ids) for ids in trained) == sorted(sorted(t.id for t in g) for g in groups)
        assert src.data_ended and src.resyncs >= 1 and src.state.cursor == end_seq and not src.state.held
        await src.close()
    finally:
        if thief is not None:
            await thief.close()
        await nc.close()


async def test_the_last_group_taken_elsewhere_before_the_marker_is_trained_before_the_end(run_config):
    """The deliveries just before the end-of-data marker go to another client: the marker that
    reaches this trainer shows the gap, so the data has not ended until those are read again."""
    nc, js = await _setup(run_config)
    thief = None
    try:
        names = NatsNames(run_config.run.id)
        rng = random.Random(5)
        first, last = make_group(rng, "first", 2), make_group(rng, "last", 2)
        await _publish(js, run_config, first)
        src = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=2, ack_wait_s=60.0)
        await src.start(js)
        batch = await src.next_batch(1, 0, None, wait_s=5.0)
        await src.commit(batch, 1, 0)
        await _publish(js, run_config, last)
        thief, taken = await _thief(run_config, 2)
        assert len(taken) == 2
        end_seq = await _publish_end(js, run_config, 2)
        trained = await _drain(src, 1, 4)
        assert trained == [[t.id for t in last]]
        assert src.data_ended and src.state.cursor == end_seq
        await src.close()
    finally:
        if thief is not None:
            await thief.close()
        await nc.close()


async def test_a_trajectory_published_after_the_marker_is_read_before_the_data_ends(run_config):
    """The server's count of undelivered messages decides with the marker: a trajectory stored
    after it (an external session finishing late) is read and trained before the end."""
    nc, js = await _setup(run_config)
    try:
        names = NatsNames(run_config.run.id)
        rng = random.Random(6)
        early, late = make_group(rng, "early", 2), make_group(rng, "late", 2)
        await _publish(js, run_config, early)
        await _publish_end(js, run_config, 2)
        await _publish(js, run_config, late)
        src = TrajectorySource(names, ConsumptionState(), Ledger(), required_trajectories=2)
        await src.start(js)
        trained = await _drain(src, 1, 4)
        assert trained == [[t.id for t in early], [t.id for t in late]]
        assert src.data_ended and not src.state.held
        await src.close()
    finally:
        await nc.close()
