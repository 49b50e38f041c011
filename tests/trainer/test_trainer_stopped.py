"""F4 (RELIABILITY.md): a trainer that stops answering (its whole process tree SIGSTOPped, as
``docker pause`` does) while it holds messages, past the consumer's ``ack_wait``.

No heartbeat comes, so ``ack_wait`` expires on what the trainer held, and the server redelivers
it on the next pull: the resumed trainer's. The trainer finds them already held (the ID and sequence
checks), trains the step as soon as its data is complete, and every trajectory is trained
exactly once (the audit: nothing twice, nothing lost, nothing pending).
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import psutil

from asyncrl.config import load_config
from asyncrl.jetstream import connect
from asyncrl.wire import NatsNames
from tests.helpers.waiting import wait_for_sync
from tests.trainer.helpers import make_group, metrics_lines, publish, start_trainer, wait_exit
from trainer_daemon.audit import audit_run

N = 2
ACK_WAIT_S = 2.0  # trainer.ack_wait_s: short, so the freeze outlasts it several times
FROZEN_S = 4 * ACK_WAIT_S  # the fault held for a duration (not a wait for a state)
RESUME_BOUND_S = 30.0  # RELIABILITY.md F4: "on resume": the step trains within this of SIGCONT
FIRST_STEP_S = 180.0  # a trainer start imports torch + transformers on two busy cores


def consumer_info(url: str, run_id: str):
    async def ask():
        nc = await connect(url, "f4-test", persistent=False)
        try:
            names = NatsNames(run_id)
            return await nc.jetstream().consumer_info(names.stream, names.trainer_consumer)
        finally:
            await nc.close()
    return asyncio.run(ask())


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def test_a_frozen_trainer_gets_redeliveries_and_trains_each_trajectory_once(module_nats, tmp_path):
    run_dir = tmp_path / "run"
    ov = [f"run.dir={run_dir}", f"nats.url={module_nats.url}", "run.id=frozen", f"rollout.n={N}", "actor.ppo_mini_batch_size=2",
          "actor.ppo_micro_batch_size_per_gpu=2", "trainer.metrics_port=0", "trainer.total_training_steps=2",
          "trainer.checkpoint.save_freq=1", "async_training.staleness_threshold=100", f"trainer.ack_wait_s={ACK_WAIT_S}"]
    cfg = load_config(overrides=ov, environ={})
    rng = random.Random(4)
    groups = [make_group(rng, f"g{i}", N) for i in range(4)]
    publish(cfg, groups[0] + groups[1])
    proc = start_trainer(run_dir, ov, name="trainer")
    try:
        wait_for_sync(lambda: len(metrics_lines(run_dir)) >= 1, FIRST_STEP_S, "the first step", procs=[proc])
        publish(cfg, groups[2])  # half of step 2: held by the trainer, waiting for the other group
        wait_for_sync(lambda: consumer_info(module_nats.url, "frozen").num_ack_pending >= N, 30, "step 2's first group held")
        frozen = tree(proc.proc.pid)
        for p in frozen:
            p.send_signal(signal.SIGSTOP)
        try:
            time.sleep(FROZEN_S)
            publish(cfg, groups[3])
        finally:
            for p in frozen:
                p.send_signal(signal.SIGCONT)
        resumed_at = time.monotonic()
        wait_for_sync(lambda: len(metrics_lines(run_dir)) >= 2, RESUME_BOUND_S, "step 2 after SIGCONT", procs=[proc])
        assert time.monotonic() - resumed_at < RESUME_BOUND_S
        assert wait_exit(proc) == 0, proc.failure("failed")
        # a pull consumer redelivers on the next pull: the resumed trainer's, which met its held messages again
        assert metrics_lines(run_dir)[-1]["trainer/redelivered_messages"] >= N, metrics_lines(run_dir)[-1]
    finally:
        proc.stop()
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "frozen"))
    assert audit.ok and (audit.lost, audit.twice, audit.pending, audit.duplicate) == (0, 0, 0, 0), audit
    assert audit.trained == 4 * N, audit
