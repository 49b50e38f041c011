"""A trainer told to stop (SIGTERM) while everything around it stops too — what ``scancel``
and Kubernetes do: every process signalled at once — still writes its checkpoint within
``trainer.stop_timeout_s``: it does not wait out a weight sync that will never end (the sync
agent holds it; its timeouts here add up to 40 minutes) nor NATS (killed with the signal).
"""

from __future__ import annotations

import random
import signal
import time

from asyncrl.config import load_config
from asyncrl.jetstream import EmbeddedNats
from tests.helpers.waiting import wait_for_sync
from tests.trainer.fake_sync_agent import FakeSyncAgent
from tests.trainer.helpers import make_group, metrics_lines, publish, start_trainer
from trainer_daemon.state.checkpoint import complete_checkpoints

N = 2
TOKEN = "sync-token-for-the-stop-test-0123"
STOP_TIMEOUT_S = 8.0
SLACK_S = 20.0  # a checkpoint of the tiny model and a busy two-core machine
FIRST_STEP_S = 180.0  # a trainer start imports torch + transformers on two busy cores


def test_a_signalled_trainer_checkpoints_within_its_budget_with_the_sync_and_nats_gone(tmp_path):
    run_dir = tmp_path / "run"
    with EmbeddedNats(tmp_path / "nats-home") as nats, FakeSyncAgent([], TOKEN) as agent:
        agent.hold = True
        ov = [f"run.dir={run_dir}", f"nats.url={nats.url}", "run.id=stopped", f"rollout.n={N}", "actor.ppo_mini_batch_size=1",
              "actor.ppo_micro_batch_size_per_gpu=2", "trainer.metrics_port=0", "async_training.trigger_parameter_sync_step=1",
              "async_training.staleness_threshold=100", f"sync.url={agent.url}", f"security.sync_token={TOKEN}",
              "sync.group_init_timeout_s=600", "sync.pause_timeout_s=600", "sync.broadcast_timeout_s=600",
              "sync.resume_timeout_s=600", "trainer.checkpoint.save_freq=0", f"trainer.stop_timeout_s={STOP_TIMEOUT_S}"]
        cfg = load_config(overrides=ov, environ={})
        rng = random.Random(7)
        publish(cfg, [t for g in range(3) for t in make_group(rng, f"g{g}", N, run_id="stopped")])
        proc = start_trainer(run_dir, ov, name="trainer-stopped")
        try:
            wait_for_sync(lambda: len(metrics_lines(run_dir)) >= 1 and agent.bodies, FIRST_STEP_S,
                          "a step and its sync accepted (and held)", procs=[proc])
            assert not complete_checkpoints(run_dir / "checkpoints")
            nats.kill()
            signalled = time.monotonic()
            proc.signal(signal.SIGTERM)  # the process group: torchrun and its worker, as scancel signals both
            wait_for_sync(lambda: complete_checkpoints(run_dir / "checkpoints"), STOP_TIMEOUT_S + SLACK_S,
                          "a checkpoint after SIGTERM")
            took = time.monotonic() - signalled
            step, _ = complete_checkpoints(run_dir / "checkpoints")[-1]
            assert step >= 1 and took < STOP_TIMEOUT_S + SLACK_S, (step, took)
            assert "exiting with a weight sync still running" in (run_dir / "logs" / "trainer-stopped.log").read_text()
        finally:
            proc.kill()
