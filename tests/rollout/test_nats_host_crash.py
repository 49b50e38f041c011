"""F3 (RELIABILITY.md): a NATS host crash loses what the server had acknowledged but not yet
written to disk (default ``sync_interval``; ``nats.sync_always=true`` fsyncs every write).

The crash is emulated by its effect, which is all a host crash leaves behind: nats-server is
SIGKILLed and the tail of the stream's block file is cut off, as unflushed pages would be.
It restarts with a shorter stream and reuses the lost sequences. The rollout service had
PubAcks for those trajectories and removed them from its outbox; its published record
(``<run dir>/rollout/published.jsonl``) still names them, so ``asyncrl audit`` records the loss
(``lost_after_ack``, a violation) — the stream's own sequences cannot show it.

With ``rollout.outbox_keep_acked_s`` (acknowledged entries kept past NATS's fsync interval)
the publisher notices the stream went back and publishes the kept entries again: nothing lost.
Not covered: a real VM reset.
"""

from __future__ import annotations

import asyncio
import glob
import os

from asyncrl.jetstream import StreamSettings, connect, ensure_stream
from asyncrl.jsonl_log import BoundedJsonl
from asyncrl.wire import NatsNames
from rollout_service.publish import Outbox, TrajectoryPublisher
from tests.rollout.test_publisher import traj
from trainer_daemon.audit import audit_run

N = 20


async def publish(nats_url: str, run_config, run_dir, ids: range, keep_acked_s: float = 0.0):
    """A rollout service's publisher (outbox, published record) publishing ``ids``; its stats."""
    nc = await connect(nats_url, "publisher", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(run_config))
        outbox = Outbox(run_dir / "rollout" / "outbox", max_items=N, keep_acked_s=keep_acked_s)
        for i in ids:
            outbox.put_ready(traj(i))
        record = BoundedJsonl(run_dir / "rollout" / "published.jsonl", 2**20)
        pub = TrajectoryPublisher(outbox, NatsNames(run_config.run.id).trajectories, lambda s, p, h: js.publish(s, p, headers=h),
                                  record)
        stop = asyncio.Event()
        task = asyncio.create_task(pub.run(stop))
        assert await pub.flush(30) and len(outbox) == 0
        stop.set()
        await task
        return pub.stats
    finally:
        await nc.close()


def host_crash(nats_server, run_dir, run_id: str) -> None:
    nats_server.kill()
    [block] = glob.glob(str(run_dir / "nats" / "**" / NatsNames(run_id).stream / "msgs" / "*.blk"), recursive=True)
    with open(block, "r+b") as f:  # the unflushed pages of the tail, gone with the host
        f.truncate(os.path.getsize(block) // 2)
    nats_server.start()


async def test_a_loss_after_ack_is_recorded_by_the_audit(tmp_path, nats_server, run_config):
    run_dir = tmp_path / "run"
    assert (await publish(nats_server.url, run_config, run_dir, range(N))).published == N
    clean = await audit_run(run_dir, nats_server.url, run_config.run.id)
    assert clean.ok and (clean.published, clean.pending, clean.lost_after_ack) == (N, N, 0), clean

    host_crash(nats_server, run_dir, run_config.run.id)

    audit = await audit_run(run_dir, nats_server.url, run_config.run.id)
    kept = audit.pending
    assert 0 < kept < N, audit
    assert audit.lost_after_ack == N - kept and not audit.ok, audit
    assert audit.lost_after_ack_ids[0] == f"t-{kept}"  # the tail, in publishing order
    assert audit.lost == 0, "the stream's sequences alone cannot see this loss"


async def test_kept_acknowledged_entries_are_published_again_after_the_loss(tmp_path, nats_server, run_config):
    """With acknowledged entries kept (``rollout.outbox_keep_acked_s``), a restarted publisher's
    first new PubAck lands at or below the highest sequence in its published record: the stream
    went back. Every kept entry is queued again; the lost ones are stored anew, the others are
    duplicates; the audit then finds nothing lost."""
    run_dir = tmp_path / "run"
    assert (await publish(nats_server.url, run_config, run_dir, range(N), keep_acked_s=600)).published == N
    host_crash(nats_server, run_dir, run_config.run.id)
    stats = await publish(nats_server.url, run_config, run_dir, range(N, N + 1), keep_acked_s=600)  # the service goes on
    assert stats.requeued_after_loss == N + 1, stats  # every kept entry, the one whose ack revealed the loss included
    audit = await audit_run(run_dir, nats_server.url, run_config.run.id)
    assert audit.ok and audit.lost_after_ack == 0 and audit.pending == N + 1, audit
    assert stats.published + stats.duplicates == N + 2  # the new one, the lost ones again, the kept ones as duplicates
