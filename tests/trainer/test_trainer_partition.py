"""F13 (RELIABILITY.md): the trainer cut off from NATS (a network partition, not a crash).

The trainer's link to NATS goes through a partitionable TCP proxy: after its first step the
link is cut for ``PARTITION_S`` while the rollout side keeps publishing (straight to NATS).
The trainer must ride it out — its fetches time out, its loop and process survive, it trains
nothing it cannot see — and once the link is back, train again within ``F13_BOUND_S`` and
finish with every trajectory trained exactly once (the audit reconciles the stream with the
ledger: nothing lost, nothing twice, nothing pending).
"""

from __future__ import annotations

import asyncio
import random
import time

from asyncrl.config import load_config
from tests.helpers.tcp_proxy import PartitionableTcpProxy
from tests.helpers.waiting import wait_for_sync
from tests.trainer.helpers import make_group, metrics_lines, publish, start_trainer, wait_exit
from trainer_daemon.audit import audit_run

N = 2
GROUPS_PER_STEP = 2
STEPS = 3
PARTITION_S = 20.0  # the cut itself (a fault held for a duration, not a wait for a state)
F13_BOUND_S = 30.0  # RELIABILITY.md F13: training again within 30 s of the link coming back
FIRST_STEP_S = 180.0  # a trainer start imports torch + transformers on two busy cores


def test_trainer_rides_out_a_partition_from_nats_and_trains_everything_once(module_nats, tmp_path):
    proxy = PartitionableTcpProxy.for_url(module_nats.url).start()
    run_dir = tmp_path / "run"
    common = [f"run.dir={run_dir}", "run.id=partition", f"rollout.n={N}", f"actor.ppo_mini_batch_size={GROUPS_PER_STEP}",
              "actor.ppo_micro_batch_size_per_gpu=2", "trainer.metrics_port=0", f"trainer.total_training_steps={STEPS}",
              "trainer.checkpoint.save_freq=1", "async_training.staleness_threshold=100"]
    direct = load_config(overrides=[*common, f"nats.url={module_nats.url}"], environ={})
    rng = random.Random(13)
    groups = [make_group(rng, f"g{i}", N) for i in range(STEPS * GROUPS_PER_STEP)]
    publish(direct, [t for g in groups[:GROUPS_PER_STEP] for t in g])
    proc = start_trainer(run_dir, [*common, f"nats.url={proxy.url()}"], name="trainer")
    try:
        wait_for_sync(lambda: len(metrics_lines(run_dir)) >= 1, FIRST_STEP_S, "the first step", procs=[proc])
        assert proxy.connections >= 1, "the trainer reaches NATS through the proxy"
        proxy.partition()
        publish(direct, [t for g in groups[GROUPS_PER_STEP:] for t in g])  # the rollout side keeps publishing
        time.sleep(PARTITION_S)
        assert proc.poll() is None, proc.failure("died during the partition")
        assert len(metrics_lines(run_dir)) == 1, "nothing crossed the cut"
        proxy.heal()
        healed_at = time.monotonic()
        wait_for_sync(lambda: len(metrics_lines(run_dir)) >= 2, F13_BOUND_S, "a step after the link came back", procs=[proc])
        assert time.monotonic() - healed_at < F13_BOUND_S
        assert wait_exit(proc) == 0, proc.failure("failed")
    finally:
        proc.stop()
        proxy.stop()
    assert [line["step"] for line in metrics_lines(run_dir)] == list(range(1, STEPS + 1))
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "partition"))
    assert audit.ok and (audit.lost, audit.twice, audit.pending) == (0, 0, 0), audit
    assert audit.trained == len(groups) * N, audit
