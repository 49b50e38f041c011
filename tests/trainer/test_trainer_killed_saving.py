"""F7: the trainer SIGKILLed while an ``async_save`` is pending (RELIABILITY.md).

The kill is placed by the ``checkpoint.write`` failpoint (``asyncrl.failpoints``): both ranks'
background writers of checkpoint 3 stop before writing their shards, so the save's future is
pending for as long as the test needs. Then the whole trainer tree is SIGKILLed. The restarted
trainer must ignore (and delete) the incomplete ``step-3``, resume from checkpoint 2, train on,
and along the final lineage every trajectory is trained exactly once (audit).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

from asyncrl.config import load_config
from asyncrl.failpoints import ENV_DIR, reached
from tests.helpers.processes import alive, process_tree
from tests.helpers.waiting import wait_for_sync
from tests.trainer.helpers import (
    NOT_YET,
    make_group,
    metrics_lines,
    publish,
    start_trainer,
    wait_exit,
)
from tests.trainer.test_trainer_resume import GROUPS_PER_STEP, STEP_WAIT_S, N, overrides
from trainer_daemon.audit import audit_run
from trainer_daemon.state.checkpoint import INCOMPLETE, MARKER, complete_checkpoints, read_state
from trainer_daemon.state.ledger import read_lineage

STEPS = 4
HELD_AT = 3  # the checkpoint whose write is pending at the kill


def test_sigkill_while_async_save_pending_resumes_from_the_previous_checkpoint(module_nats, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    fp = tmp_path / "failpoints"
    fp.mkdir()
    monkeypatch.setenv(ENV_DIR, str(fp))
    ov = overrides(run_dir, module_nats.url, "f7", f"trainer.total_training_steps={STEPS}", "trainer.checkpoint.save_freq=1",
                   "trainer.checkpoint.async_save=true", "trainer.checkpoint.keep_last=3", "trainer.checkpoint.export_hf=false")
    cfg = load_config(overrides=ov, environ={})
    rng = random.Random(7)
    trajs = [t for g in range(STEPS * GROUPS_PER_STEP) for t in make_group(rng, f"s{g}", N)]
    first = (HELD_AT - 1) * GROUPS_PER_STEP * N
    publish(cfg, trajs[:first])  # exactly enough for the steps before the held one: the trainer then waits for data

    ckpts = run_dir / "checkpoints"
    proc = start_trainer(run_dir, ov, nproc=2, name="f7-1")
    try:
        wait_for_sync(lambda: [s for s, _ in complete_checkpoints(ckpts)] == list(range(1, HELD_AT)), STEP_WAIT_S,
                      f"checkpoints 1..{HELD_AT - 1} complete", procs=[proc], retry_on=NOT_YET)
        (fp / "checkpoint.write.arm").touch()
        publish(cfg, trajs[first:])
        wait_for_sync(lambda: len(reached(fp, "checkpoint.write")) == 2, STEP_WAIT_S,
                      f"both ranks' writers of checkpoint {HELD_AT} held", procs=[proc])
        pending = ckpts / f"step-{HELD_AT:08d}{INCOMPLETE}"
        assert pending.is_dir() and not (pending / MARKER).exists()
        assert not list((pending / "dcp").glob("*.distcp")), "a shard was written before the failpoint"
        tree = process_tree(proc.pid)
        for p in tree:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for_sync(lambda: not alive(tree), 15.0, "every process of the trainer to die")
    finally:
        proc.kill()
    assert [s for s, _ in complete_checkpoints(ckpts)] == list(range(1, HELD_AT)), "the killed save was marked complete"

    (fp / "checkpoint.write.arm").unlink()
    steps_before = len(metrics_lines(run_dir))
    proc = start_trainer(run_dir, ov, nproc=2, name="f7-2")
    try:
        assert wait_exit(proc) == 0, proc.failure("the restarted trainer failed")
    finally:
        proc.stop()
    log = (run_dir / "logs" / "f7-2.log").read_text()
    assert f"step-{HELD_AT - 1:08d} (step {HELD_AT - 1}," in log, "did not resume from the checkpoint before the killed save"
    assert not (ckpts / f"step-{HELD_AT:08d}{INCOMPLETE}").exists(), "the incomplete directory was left behind"
    resumed = [int(m["trainer/global_step"]) for m in metrics_lines(run_dir)[steps_before:]]
    assert resumed == list(range(HELD_AT, STEPS + 1)), resumed

    final_step, final_dir = complete_checkpoints(ckpts)[-1]
    assert final_step == STEPS and read_state(final_dir)["step"] == STEPS
    entries = read_lineage(ckpts, final_step)
    # the step trained before the kill (and lost with it) is on the record, with its trajectories
    lost = [s for e in entries for s in e.get("lost_steps", [])]
    assert HELD_AT in [s["step"] for s in lost], entries
    assert {i for s in lost for i in s["trained"]} <= {t.id for t in trajs}
    assert all(e["generated_by"] == [[0, 0]] * len(e["trained"]) for e in entries if e["trained"])
    assert (ckpts / "ledger" / "journal.jsonl").read_text() == "", "the journal is trimmed at the last checkpoint"
    trained = [i for e in entries for i in e["trained"]]
    assert sorted(trained) == sorted(t.id for t in trajs), "along the lineage, not every trajectory trained exactly once"
    audit = asyncio.run(audit_run(run_dir, module_nats.url, "f7"))
    assert audit.ok and (audit.lost, audit.twice, audit.pending) == (0, 0, 0), audit
    assert audit.trained == len(trajs) and audit.lost_steps == len(lost) >= 1, audit
