"""F14 (consumer stall): a JetStream server stops delivering to a pull consumer, silently, once
``max_ack_pending`` messages are unacked. The trainer must never get there: it asks for at
most ``max_ack_pending - held`` messages and only while it lacks a step's groups, and its
limit (``consumer_limits``) is at least twice a step plus twice the group patience.

Driven here with a backlog of twice ``max_ack_pending`` waiting in the stream before the
trainer starts (the shape of a trainer slower than its rollout): at every step the consumer's
``num_ack_pending`` (as the trainer exports it) stays below the limit by more than a step, the
backlog is still there, nothing is redelivered, and every step trains. The alert
``ConsumerAtMaxAckPending`` stays as a guard for a consumer configured by hand.
"""

from __future__ import annotations

import asyncio
import random

from asyncrl.config import load_config
from asyncrl.jetstream import connect
from asyncrl.wire import NatsNames
from tests.trainer.helpers import make_group, metrics_lines, publish, start_trainer, wait_exit
from trainer_daemon.consume.source import FETCH_BATCH_MAX, consumer_limits

N = 2
GROUPS_PER_STEP = 2
STEPS = 4


async def _trajectories_in_stream(cfg) -> int:
    nc = await connect(cfg.nats.url, "test-inspect", persistent=False)
    try:
        names = NatsNames(cfg.run.id)
        info = await nc.jetstream().stream_info(names.stream, subjects_filter=names.trajectories)
        return int((info.state.subjects or {}).get(names.trajectories, 0))
    finally:
        await nc.close()


def test_a_backlog_twice_max_ack_pending_never_stalls_the_consumer(module_nats, tmp_path):
    required = GROUPS_PER_STEP * N
    _, max_ack = consumer_limits(required)
    run_dir = tmp_path / "run"
    ov = [f"run.dir={run_dir}", f"nats.url={module_nats.url}", "run.id=backlog", f"rollout.n={N}",
          f"actor.ppo_mini_batch_size={GROUPS_PER_STEP}", "actor.ppo_micro_batch_size_per_gpu=4", "trainer.metrics_port=0",
          f"trainer.total_training_steps={STEPS}", "trainer.checkpoint.export_hf=false"]
    cfg = load_config(overrides=ov, environ={})
    rng = random.Random(14)
    backlog = [t for g in range(max_ack + 8) for t in make_group(rng, f"b{g}", N)]  # 2 × max_ack + 16 messages
    publish(cfg, backlog)

    proc = start_trainer(run_dir, ov, name="backlog")
    try:
        assert wait_exit(proc) == 0, proc.failure("failed")
    finally:
        proc.stop()
    lines = metrics_lines(run_dir)
    assert [int(m["trainer/global_step"]) for m in lines] == list(range(1, STEPS + 1))
    # without periodic checkpoints the stream is purged through the committed cursor at every step
    remaining = asyncio.run(_trajectories_in_stream(cfg))
    assert remaining == len(backlog) - int(lines[-1]["trainer/stream_cursor"]), (remaining, lines[-1]["trainer/stream_cursor"])
    assert remaining < len(backlog)
    for m in lines:
        assert m["trainer/consumer_max_ack_pending"] == max_ack
        assert m["trainer/consumer_ack_pending"] <= required + FETCH_BATCH_MAX < max_ack - required, m
        assert m["trainer/consumer_lag"] > max_ack, "the backlog was not waiting in the stream"
        assert m["trainer/redelivered_messages"] == 0, m
