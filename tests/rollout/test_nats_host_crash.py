"""F3 (RELIABILITY.md): a NATS host crash loses what the server had acknowledged but not yet
written to disk (default ``sync_interval``; ``nats.sync_always=true`` fsyncs every write).

The crash is emulated by its effect, which is all a host crash leaves behind: nats-server is
SIGKILLed and the tail of the stream's block file is cut off, as unflushed pages would be.
It restarts with a shorter stream and reuses the lost sequences. The rollout service had
PubAcks for those trajectories and removed them from its outbox; its published record
(``<run dir>/rollout/published.jsonl``) still names them, so ``asyncrl audit`` records the loss
(``lost_after_ack``, a violation) — the stream's own sequences cannot show it.

Not covered here: a real VM reset; re-publishing the lost tail (the outbox keeps nothing after
a PubAck).
"""

from __future__ import annotations

import asyncio
import glob
import os

from asyncrl.jetstream import connect, ensure_stream
from asyncrl.jsonl_log import BoundedJsonl
from asyncrl.wire import NatsNames
from rollout_service.publish import Outbox, TrajectoryPublisher
from tests.rollout.test_publisher import traj
from trainer_daemon.audit import audit_run

N = 20


async def publish_all(nats_url: str, run_config, run_dir) -> None:
    nc = await connect(nats_url, "publisher", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, run_config)
        outbox = Outbox(run_dir / "rollout" / "outbox", max_items=N)
        for i in range(N):
            outbox.put_ready(traj(i))
        record = BoundedJsonl(run_dir / "rollout" / "published.jsonl", 2**20)
        pub = TrajectoryPublisher(outbox, NatsNames(run_config.run.id).trajectories, lambda s, p, h: js.publish(s, p, headers=h),
                                  record)
        stop = asyncio.Event()
        task = asyncio.create_task(pub.run(stop))
        assert await pub.flush(30) and pub.stats.published == N and len(outbox) == 0
        stop.set()
        await task
    finally:
        await nc.close()


async def test_a_loss_after_ack_is_recorded_by_the_audit(tmp_path, nats_server, run_config):
    run_dir = tmp_path / "run"
    await publish_all(nats_server.url, run_config, run_dir)
    clean = await audit_run(run_dir, nats_server.url, run_config.run.id)
    assert clean.ok and (clean.published, clean.pending, clean.lost_after_ack) == (N, N, 0), clean

    nats_server.kill()
    names = NatsNames(run_config.run.id)
    [block] = glob.glob(str(run_dir / "nats" / "**" / names.stream / "msgs" / "*.blk"), recursive=True)
    with open(block, "r+b") as f:  # the unflushed pages of the tail, gone with the host
        f.truncate(os.path.getsize(block) // 2)
    nats_server.start()

    audit = await audit_run(run_dir, nats_server.url, run_config.run.id)
    kept = audit.pending
    assert 0 < kept < N, audit
    assert audit.lost_after_ack == N - kept and not audit.ok, audit
    assert audit.lost_after_ack_ids[0] == f"t-{kept}"  # the tail, in publishing order
    assert audit.lost == 0, "the stream's sequences alone cannot see this loss"
