"""The rollout's end of data (asyncrl.wire.end_of_data) ends a trainer that could otherwise
wait forever: samples dropped or groups left incomplete leave fewer than its total steps need.

Published here: one whole group, half of another (its other members never come), then the
end-of-data message. The trainer has no total (``total_rollout_steps`` unset), a step takes
two groups. It must release the incomplete group at once (not after its patience), train the
one step the two groups make, and exit 0 instead of idling; its ledger accounts for the
message, and ``asyncrl audit`` finds nothing lost.

Issue 29: a finite run must end with every published trajectory trained or dropped, also when
the trainer restarts from a checkpoint taken after it read the marker, and when the groups
left are too few for a whole step (trained as a last, smaller step).
"""

from __future__ import annotations

import asyncio
import json
import random

from asyncrl.config import load_config
from asyncrl.jetstream import StreamSettings, connect, ensure_stream
from asyncrl.launch import free_port, log_tail
from asyncrl.wire import NatsNames, end_of_data_message
from tests.trainer.helpers import make_group, metrics_lines, publish, start_trainer, wait_exit
from trainer_daemon.audit import audit_run
from trainer_daemon.state.ledger import read_lineage

N = 4


async def _publish_end(cfg, samples: int, trajectories: int) -> int:
    nc = await connect(cfg.nats.url, "test-rollout", persistent=False)
    try:
        js = nc.jetstream()
        await ensure_stream(js, StreamSettings.of(cfg))
        body, headers = end_of_data_message(cfg.run.id, samples, trajectories)
        return (await js.publish(NatsNames(cfg.run.id).trajectories, body, headers=headers, timeout=10)).seq
    finally:
        await nc.close()


def _config(run_dir, url: str, run_id: str, *extra: str) -> tuple[list[str], object]:
    overrides = [f"run.dir={run_dir}", f"nats.url={url}", f"run.id={run_id}", f"rollout.n={N}",
                 "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "trainer.metrics_port=0",
                 f"trainer.master_port={free_port()}", 'trainer.loggers=["jsonl"]', *extra]
    return overrides, load_config(overrides=overrides, environ={})


def _run_trainer(run_dir, overrides: list[str]) -> None:
    proc = start_trainer(run_dir, overrides)
    try:
        assert wait_exit(proc, 240) == 0, log_tail(run_dir / "logs" / "trainer.log")
    finally:
        proc.stop()


def test_a_restart_after_the_end_of_data_trains_what_precedes_it_and_the_groups_left(module_nats, tmp_path):
    """Three whole groups and the marker, two groups a step. The first run stops after one
    step (``total_training_steps=1``) with the marker read and resolved in its checkpoint and the
    third group held, not resolved: the state a trainer killed after a checkpoint is restored
    to. The restarted trainer (no total) must read the third group again, train it as a last
    step of one group, and exit; the audit then finds every trajectory trained."""
    run_dir = tmp_path / "run"
    overrides, cfg = _config(run_dir, module_nats.url, "eod-restart")
    groups = [make_group(random.Random(5), f"g{i}", N) for i in range(3)]
    seqs = publish(cfg, [t for g in groups for t in g])
    end_seq = asyncio.run(_publish_end(cfg, samples=3, trajectories=3 * N))
    _run_trainer(run_dir, [*overrides, "trainer.total_training_steps=1"])
    state = json.loads((run_dir / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())["consumption"]
    assert [end_seq, "end", ""] in state["above"] and state["cursor"] == seqs[2 * N - 1], state  # the precondition
    assert asyncio.run(audit_run(run_dir, module_nats.url, "eod-restart")).pending == N  # the third group waits

    _run_trainer(run_dir, overrides)
    lines = metrics_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[-1]["trainer/trained_trajectories"] == 3 * N and lines[-1]["trainer/stream_cursor"] == end_seq
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "eod-restart"))
    assert audit.ok and audit.pending == 0 and audit.trained == 3 * N and audit.end == 1, audit


def test_the_end_of_data_releases_what_waits_trains_what_forms_a_step_and_stops(module_nats, tmp_path):
    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", f"nats.url={module_nats.url}", "run.id=eod", f"rollout.n={N}",
                 "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4", "trainer.metrics_port=0",
                 f"trainer.master_port={free_port()}", 'trainer.loggers=["jsonl"]']
    cfg = load_config(overrides=overrides, environ={})
    rng = random.Random(3)
    whole, half = make_group(rng, "g-whole", N), make_group(rng, "g-half", N)[:2]
    publish(cfg, whole + half)
    end_seq = asyncio.run(_publish_end(cfg, samples=2, trajectories=N + 2))
    proc = start_trainer(run_dir, overrides)
    try:
        assert wait_exit(proc, 240) == 0, log_tail(run_dir / "logs" / "trainer.log")
    finally:
        proc.stop()
    lines = metrics_lines(run_dir)
    assert [line["step"] for line in lines] == [1]
    assert lines[0]["trainer/trained_trajectories"] == N + 2 and lines[0]["trainer/incomplete_groups"] == 1
    entries = read_lineage(run_dir / "checkpoints", 1)
    assert any(end_seq in e.get("end", []) for e in entries), entries
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "eod"))
    assert audit.ok and audit.end == 1 and audit.lost == 0 and audit.trained == N + 2 and audit.published == N + 2, audit


def test_a_finish_with_messages_neither_trained_nor_dropped_exits_non_zero_naming_them(module_nats, tmp_path):
    """Issue 65: the end of a run is declared only when every message the rollout published is
    trained or dropped. Here the checkpoint's consumption state claims the whole stream resolved
    (its cursor moved to the marker) while the ledger holds one group fewer: the state the
    end-of-data resync left behind before the fix. The restarted trainer finds the data ended,
    and its end audit finds that group unconsumed: it exits 1 and names the ids; started again,
    it refuses at once (no restart loop under compose's ``restart: on-failure``)."""
    run_dir = tmp_path / "run"
    overrides, cfg = _config(run_dir, module_nats.url, "eod-unresolved")
    groups = [make_group(random.Random(6), f"g{i}", N) for i in range(3)]
    publish(cfg, [t for g in groups for t in g])
    end_seq = asyncio.run(_publish_end(cfg, samples=3, trajectories=3 * N))
    _run_trainer(run_dir, [*overrides, "trainer.total_training_steps=1"])
    path = run_dir / "checkpoints" / "step-00000001" / "trainer_state.json"
    state = json.loads(path.read_text())
    state["consumption"]["cursor"] = end_seq  # the third group (and the marker) claimed resolved
    state["consumption"]["above"] = []
    path.write_text(json.dumps(state))

    proc = start_trainer(run_dir, overrides)
    try:
        assert wait_exit(proc, 240) == 1
    finally:
        proc.stop()
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "the run ended at step 1 with the stream not accounted for: 4 unconsumed at the end" in log, log_tail(run_dir / "logs" / "trainer.log")
    assert all(t.id in log for t in groups[2]), "the unconsumed ids are named"
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "eod-unresolved"))
    assert audit.finished == "data_ended" and audit.unconsumed_at_end == N and not audit.ok, audit
    # started again (a restart policy), it refuses at once with the same finding instead of ending the run again
    (run_dir / "logs" / "trainer.log").unlink()
    proc = start_trainer(run_dir, overrides)
    try:
        assert wait_exit(proc, 240) == 1
    finally:
        proc.stop()
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "refusing to start: the run ended at step 1 with the stream not accounted for: 4 unconsumed" in log, log[-3000:]
    assert "trainer ready" not in log and "weights version" not in log, "nothing trained or published"
