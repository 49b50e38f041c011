"""Outbox + publisher against a real nats-server: nothing lost, nothing duplicated."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from asyncrl.jetstream import StreamSettings, connect, ensure_stream
from asyncrl.wire import NatsNames, Trajectory, decode_trajectory
from rollout_service.publish import Outbox, TrajectoryPublisher
from tests.helpers.waiting import wait_for


def traj(i: int, group: str = "g", size: int = 1, index: int = 0, messages=None) -> Trajectory:
    return Trajectory(id=f"t-{i}", run_id="demo", group_id=group, group_size=size, group_index=index, prompt_id="p",
                      data_source="d", token_ids=[1, 2, 3], prompt_length=2, loss_mask=[1], rollout_logprobs=[-0.5],
                      weight_versions=[0], messages=messages)


async def stored_ids(js, cfg) -> list[str]:
    names = NatsNames(cfg.run.id)
    sub = await js.pull_subscribe(names.trajectories, durable=None)
    ids = []
    while True:
        try:
            msgs = await sub.fetch(100, timeout=0.5)
        except TimeoutError:
            return ids
        ids += [decode_trajectory(m.data).id for m in msgs]


async def test_outage_and_lost_acks_lose_and_duplicate_nothing(run_config, nats_server, tmp_path: Path):
    nc = await connect(nats_server.url, "publisher")
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(run_config))
    outbox = Outbox(tmp_path / "outbox", max_items=1000)
    lost = {"count": 0}

    async def publish_losing_some_acks(subject, payload, headers):
        ack = await js.publish(subject, payload, headers=headers, timeout=2)
        if lost["count"] < 5:  # the first five acks "get lost" after the server stored the message
            lost["count"] += 1
            raise TimeoutError("ack lost")
        return ack

    pub = TrajectoryPublisher(outbox, NatsNames(run_config.run.id).trajectories, publish_losing_some_acks)
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    for i in range(20):
        outbox.put_ready(traj(i))
    pub.notify()
    assert await pub.flush(30)
    nats_server.kill()  # outage: SIGKILL, as a crash
    for i in range(20, 60):
        outbox.put_ready(traj(i))
    pub.notify()
    retries = pub.stats.retries
    await wait_for(lambda: pub.stats.retries > retries, 30, "a publish attempt to fail while NATS is down")
    assert len(outbox) > 0, "nothing can be published while NATS is down"
    nats_server.start()
    assert await pub.flush(60), f"outbox not drained after NATS came back: {pub.stats}"
    stop.set()
    await task
    ids = await stored_ids(js, run_config)
    assert sorted(ids) == sorted(f"t-{i}" for i in range(60))
    assert pub.stats.duplicates >= 1 and pub.stats.retries >= 5  # the retried t-0 landed as a duplicate
    await nc.close()


async def test_outbox_survives_a_restart_and_republishing_is_deduplicated(run_config, nats_server, tmp_path: Path):
    nc = await connect(nats_server.url, "publisher")
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(run_config))
    subject = NatsNames(run_config.run.id).trajectories
    outbox = Outbox(tmp_path / "outbox", max_items=10)
    for i in range(3):
        outbox.put_ready(traj(i))
    # a crash after the server stored t-0 but before the outbox forgot it
    await js.publish(subject, outbox.read(outbox.ready_entries()[0]), headers={"Nats-Msg-Id": "t-0"})
    reopened = Outbox(tmp_path / "outbox", max_items=10)  # the "restarted" service
    assert len(reopened) == 3 and reopened.contains("t-2")
    pub = TrajectoryPublisher(reopened, subject, lambda s, p, h: js.publish(s, p, headers=h))
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    assert await pub.flush(20)
    stop.set()
    await task
    assert sorted(await stored_ids(js, run_config)) == ["t-0", "t-1", "t-2"]
    assert pub.stats.duplicates == 1 and pub.stats.published == 2
    await nc.close()


def test_outbox_bound_is_backpressure(tmp_path: Path):
    outbox = Outbox(tmp_path, max_items=3)
    outbox.put_ready(traj(1))
    outbox.hold(traj(2, group="g2", size=2, index=0))
    assert outbox.has_room()
    outbox.hold(traj(3, group="g2", size=2, index=1))
    assert not outbox.has_room() and len(outbox) == 3
    assert outbox.release_group("g2") == 2
    assert [e.trajectory_id for e in outbox.ready_entries()] == ["t-1", "t-2", "t-3"]
    outbox.ack(outbox.ready_entries()[0])
    assert outbox.has_room() and len(Outbox(tmp_path, max_items=3)) == 2


async def test_too_large_is_stripped_then_rejected_not_dropped(tmp_path: Path, nats_server):
    from asyncrl.config import load_config

    cfg = load_config(overrides=[f"run.dir={tmp_path}", "model.max_model_len=16"], environ={})
    nc = await connect(nats_server.url, "publisher")
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(cfg))
    limit = cfg.derived.max_message_bytes
    outbox = Outbox(tmp_path / "outbox", max_items=10)
    outbox.put_ready(traj(1, messages=[{"role": "user", "content": "x" * (limit + 10)}]))  # fits once stripped
    huge = traj(2)
    huge = Trajectory(**{**{f: getattr(huge, f) for f in huge.__struct_fields__},
                         "token_ids": [100_000] * (limit // 2), "prompt_length": limit // 2 - 1})  # 5 bytes each
    outbox.put_ready(huge)  # too large even without messages
    pub = TrajectoryPublisher(outbox, NatsNames(cfg.run.id).trajectories, lambda s, p, h: js.publish(s, p, headers=h))
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    assert await pub.flush(20)
    stop.set()
    await task
    assert pub.stats.stripped_messages == 1 and pub.stats.rejected == 1
    assert outbox.rejected_count() == 1 and "t-2" in {p.stem for p in outbox.rejected_dir.glob("*.traj")}
    assert await stored_ids(js, cfg) == ["t-1"]
    await nc.close()


def histogram(pub: TrajectoryPublisher, name: str) -> dict[str, float]:
    """``_count``, ``_sum`` and the cumulative ``le`` buckets of one of the publisher's histograms."""
    out: dict[str, float] = {}
    for family in pub.latency.collect():
        for s in family.samples:
            if s.name == f"{name}_count" or s.name == f"{name}_sum":
                out[s.name.removeprefix(name)] = s.value
            elif s.name == f"{name}_bucket":
                out[s.labels["le"]] = s.value
    return out


async def test_publish_latency_histograms_count_every_ack_and_the_outbox_wait(run_config, nats_server, tmp_path: Path):
    nc = await connect(nats_server.url, "publisher")
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(run_config))
    outbox = Outbox(tmp_path / "outbox", max_items=100)
    failures = {"left": 2}

    async def publish_failing_twice(subject, payload, headers):
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("no connection")
        return await js.publish(subject, payload, headers=headers, timeout=5)

    pub = TrajectoryPublisher(outbox, NatsNames(run_config.run.id).trajectories, publish_failing_twice)
    paths = [outbox.put_ready(traj(i)) for i in range(6)]
    for p in paths[:3]:  # three trajectories "finished" 20 s ago and waited in the outbox since
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - 20.0))
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    assert await pub.flush(30)
    stop.set()
    await task
    request = histogram(pub, "asyncrl_rollout_publish_request_seconds")
    delay = histogram(pub, "asyncrl_rollout_publish_delay_seconds")
    assert pub.stats.published == 6 and pub.stats.retries == 2
    assert request["_count"] == 6, "one observation per acknowledged request, failed attempts excluded"
    assert delay["_count"] == 6
    assert delay["10.0"] == 3 and delay["+Inf"] - delay["10.0"] == 3, delay  # the 20 s waits land above 10 s
    assert delay["_sum"] >= 60.0
    await nc.close()


async def test_an_async_ready_write_counts_before_the_publisher_can_ack_it(tmp_path: Path, monkeypatch):
    """The publisher may publish and ack a ready file before the writer's await returns: the
    entry must already be counted then, or the count goes negative (found at 1,024 agents)."""
    import threading

    from rollout_service.publish import outbox as outbox_module

    outbox = Outbox(tmp_path / "outbox", max_items=10)
    written, release = threading.Event(), threading.Event()
    real_write = outbox_module.atomic_write

    def slow_write(path, data):
        real_write(path, data)
        written.set()
        release.wait(10)  # the writer's thread has not returned yet

    monkeypatch.setattr(outbox_module, "atomic_write", slow_write)
    task = asyncio.create_task(outbox.put_ready_async(traj(1)))
    await asyncio.to_thread(written.wait, 10)
    assert len(outbox) == 1
    entry = outbox.ready_entries()[0]
    outbox.ack(entry, 1)  # the publisher got there first
    assert len(outbox) == 0 and outbox.has_room()
    release.set()
    await task
    assert len(outbox) == 0


async def test_acknowledged_entries_are_kept_for_the_window_then_pruned(tmp_path: Path, monkeypatch):
    """``outbox_keep_acked_s``: acknowledged entries stay in ``acked/`` (for a requeue after a
    NATS host crash) until they are older than the window, then the publisher drops them."""
    from types import SimpleNamespace

    from rollout_service.publish import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "PRUNE_EVERY_S", 0.0)
    outbox = Outbox(tmp_path / "outbox", max_items=100, keep_acked_s=60.0)
    seqs = iter(range(1, 1000))

    async def publish(subject, payload, headers):
        return SimpleNamespace(seq=next(seqs), duplicate=False)

    old = [outbox.put_ready(traj(i)) for i in range(5)]
    for p in old:  # written (and so acknowledged, for the window) two minutes ago
        os.utime(p, (p.stat().st_atime, p.stat().st_mtime - 120.0))
    pub = TrajectoryPublisher(outbox, "subject", publish)
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    assert await pub.flush(10)
    for i in range(5, 8):  # fresh entries: kept for the window
        outbox.put_ready(traj(i))
    pub.notify()
    assert await pub.flush(10)
    await wait_for(lambda: len(list(outbox.acked_dir.iterdir())) == 3, 10, "the old acknowledged entries pruned")
    stop.set()
    await task
    assert sorted(p.name.split("-", 1)[1] for p in outbox.acked_dir.iterdir()) == ["t-5.traj", "t-6.traj", "t-7.traj"]
    assert len(outbox) == 0


async def test_flush_waits_until_the_acknowledged_window_is_counted(run_config, nats_server, tmp_path: Path):
    """Found by CI: a window's acknowledged files leave ``ready/`` (in a worker thread) before
    the outbox's count and the publisher's stats are updated; ``flush`` returned True in that
    gap. Here the gap is held open until ``flush`` has been waiting in it."""
    nc = await connect(nats_server.url, "publisher")
    js = nc.jetstream()
    await ensure_stream(js, StreamSettings.of(run_config))
    files_gone, release = asyncio.Event(), asyncio.Event()

    class GappedOutbox(Outbox):
        async def ack_many(self, acks):
            for entry, _ in acks:  # the files go first, as in the real worker-thread call
                entry.path.unlink()
            files_gone.set()
            await release.wait()
            self._count -= len(acks)

    outbox = GappedOutbox(tmp_path / "outbox", max_items=100)
    pub = TrajectoryPublisher(outbox, NatsNames(run_config.run.id).trajectories,
                              lambda s, p, h: js.publish(s, p, headers=h))
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    try:
        for i in range(5):
            outbox.put_ready(traj(i))
        pub.notify()
        await asyncio.wait_for(files_gone.wait(), 30)
        assert outbox.ready_entries() == [] and len(outbox) == 5
        flushed = asyncio.create_task(pub.flush(30))
        await asyncio.sleep(0.3)  # flush polls every 0.05 s: it has seen the empty ready/ several times
        assert not flushed.done(), "flush returned while the acknowledged window was still being counted"
        release.set()
        assert await asyncio.wait_for(flushed, 30)
        assert len(outbox) == 0 and pub.stats.published == 5
    finally:
        release.set()
        stop.set()
        await task
        await nc.close()
