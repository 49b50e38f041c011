"""Issue 47: a finite run ends with every published trajectory trained or dropped with a
counted reason, none twice, after a crash at any point near its end.

The whole loop runs as real processes (``launcher.up.stack.Stack``: embedded NATS, one local
engine with the demo policy, the rollout service, the sync agent, a torchrun trainer): 24
prompts x 2 samples, 4 trajectories a step (12 steps), a checkpoint every 3 steps, a sync every
step in 64 KiB buckets. One fault per test, each struck at a state the test drives to and
checks (a SIGSTOP freezes a process while the test looks; failpoints hold the trainer), never
at a moment guessed by a timer:

- the trainer SIGKILLed before the rollout's last publish (the rollout frozen while it is
  checked that the marker is not in the stream yet);
- the trainer SIGKILLed after the end-of-data marker was published but before it was read (the
  engine held by failpoint ``local_engine.step`` until the trainer is up and frozen; then the
  rollout, its staleness quota never binding, plays its data out while the trainer cannot read);
- the trainer SIGKILLed while the last step is assembled (failpoint ``trainer.step.12``: the
  last step's batch taken from the stream, nothing committed);
- the trainer SIGKILLed during the last step's sync (``trainer.sync_bucket``: the engines hold
  part of the new weights);
- the trainer SIGKILLed at step 8, between its checkpoints 6 and 9, with the rollout as far
  ahead as its quota allows (issue 65): the restarted trainer drops whole groups generated on
  the lost steps' weights as too stale, and must still reach the end with all of them accounted for;
- the rollout service SIGKILLed near the end (the trainer frozen at step 6, so the rollout,
  held by its staleness quota, cannot have finished), then started again;
- NATS SIGKILLed near the end (the same state) and started again on its store.

Each time the trainer is started again (or runs on) and must exit 0 by itself; then
``asyncrl audit`` must find 48 published, every one trained or dropped, none twice, nothing
lost, nothing unconsumed at the end, the run marked finished, and its final checkpoint at its
last step (step 12 when nothing was dropped).

``./dev test`` runs issue 47's own case (the marker published but unread) and issue 65's
(between checkpoints); ``./dev test-endings`` runs all seven, and two runs under ``sync.pause_policy = "per_request"`` (issue
51): one without a fault (its cancels and exact aborts keep the accounting whole), one with the
rollout service SIGKILLed inside a per-request pause and started again; about 6 minutes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from asyncrl import failpoints
from asyncrl.jetstream import connect
from asyncrl.wire import NatsNames, is_end_of_data
from tests.helpers.run_health import get_json
from tests.helpers.waiting import wait_for
from trainer_daemon.audit import audit_run

SAMPLES, N, PER_STEP = 24, 2, 4
TRAJECTORIES = SAMPLES * N
LAST_STEP = TRAJECTORIES // PER_STEP
RUN_S = 300.0  # the run (or its rest) to its end on a busy 2-core machine
REACH_S = 180.0  # a step or state inside the run
ENDINGS = "endings_slice"


class FiniteRun:
    """The stack, the run directory, the failpoint directory and the probes the tests use."""

    def __init__(self, stack, run_dir: Path, fp_dir: Path) -> None:
        self.stack, self.run_dir, self.fp = stack, run_dir, fp_dir
        self.names = NatsNames(stack.doc["run"]["id"])

    def steps(self) -> list[int]:
        path = self.run_dir / "metrics" / "trainer.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]

    def step(self) -> int:
        return max(self.steps(), default=0)

    def published(self) -> int:
        path = self.run_dir / "rollout" / "published.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    async def marker_stored(self) -> bool:
        nc = await connect(self.stack.nats_url, "test-probe", persistent=False, **self.stack.nats_auth())
        try:
            msg = await nc.jetstream().get_last_msg(self.names.stream, self.names.trajectories)
            return is_end_of_data(msg.headers)
        except Exception:  # noqa: BLE001 - nothing stored yet
            return False
        finally:
            await nc.close()

    def child(self, name: str):
        return self.stack.children[name]

    def restart(self, name: str) -> None:
        old = self.child(name)
        self.stack._child(name, old.argv, env=old.env)

    def arm(self, name: str) -> None:
        (self.fp / f"{name}.arm").touch()

    def release(self, name: str) -> None:
        (self.fp / f"{name}.release").touch()

    def disarm_all(self) -> None:
        for p in self.fp.iterdir():
            p.unlink()

    async def reached(self, name: str) -> None:
        await wait_for(lambda: failpoints.reached(self.fp, name), REACH_S, f"failpoint {name}", procs=[self.child("trainer")])

    async def at_step(self, step: int) -> None:
        await wait_for(lambda: self.step() >= step, REACH_S, f"trainer step {step}", procs=[self.child("trainer")])


@asynccontextmanager
async def finite_run(tmp_path: Path, *extra: str, hold_engine: bool = False):
    """The stack; ``hold_engine``: failpoint ``local_engine.step`` armed once the engine is up and
    before the rollout service starts, so nothing is generated until the test releases it."""
    from asyncrl.config import load_config
    from launcher.up.main import demo_config_path, demo_policy
    from launcher.up.stack import Stack

    run_dir, fp_dir = tmp_path / "run", tmp_path / "failpoints"
    shutil.rmtree(run_dir, ignore_errors=True)
    fp_dir.mkdir(parents=True)
    cfg = load_config(demo_config_path(), [
        f"model.path={demo_policy()}", f"run.dir={run_dir}", "run.id=finite", f"rollout.n={N}",
        f"rollout.total_rollout_steps={SAMPLES}", f"actor.ppo_mini_batch_size={PER_STEP // N}",
        "trainer.checkpoint.save_freq=3", "sync.bucket_bytes=65536", 'trainer.loggers=["jsonl"]', *extra])
    stack = Stack(cfg, run_dir)
    before = os.environ.get(failpoints.ENV_DIR)
    os.environ[failpoints.ENV_DIR] = str(fp_dir)  # every child inherits it
    try:
        def progress(message: str) -> None:
            if hold_engine and message.startswith("starting the rollout service"):
                (fp_dir / "local_engine.step.arm").touch()

        await asyncio.to_thread(stack.start, progress)
        yield FiniteRun(stack, run_dir, fp_dir)
    finally:
        for name in ("trainer", "rollout"):
            if name in stack.children:
                stack.children[name].signal(signal.SIGCONT)
        await asyncio.to_thread(stack.stop)
        if before is None:
            os.environ.pop(failpoints.ENV_DIR, None)
        else:
            os.environ[failpoints.ENV_DIR] = before


async def kill_and_restart_trainer(run: FiniteRun) -> None:
    await asyncio.to_thread(run.child("trainer").kill)
    run.disarm_all()
    run.restart("trainer")


async def finish_and_audit(run: FiniteRun) -> None:
    trainer = run.child("trainer")
    await wait_for(lambda: trainer.poll() is not None, RUN_S, "the trainer to end the run by itself", procs=[run.child("rollout")])
    assert trainer.poll() == 0, trainer.failure("ended the run")
    await wait_for(run.marker_stored, RUN_S, "the rollout's end-of-data marker", procs=[run.child("rollout")])
    audit = await audit_run(run.run_dir, run.stack.nats_url, "finite")
    logs = run.run_dir / "logs"
    assert audit.published == TRAJECTORIES, (audit, logs)
    assert audit.trained + audit.dropped == TRAJECTORIES and audit.twice == 0 and audit.lost == 0, (audit, logs)
    assert audit.ok and audit.unconsumed_at_end == 0 and audit.finished in ("data_ended", "total_steps"), (audit, logs)
    last = run.step()
    assert audit.checkpoint_step == last, (audit, run.steps())
    if audit.dropped == 0:
        assert last == LAST_STEP, (audit, run.steps())


async def trainer_before_the_last_publish(run: FiniteRun) -> None:
    await run.at_step(5)
    run.child("rollout").signal(signal.SIGSTOP)
    assert not await run.marker_stored() and run.published() < TRAJECTORIES  # the precondition
    await kill_and_restart_trainer(run)
    run.child("rollout").signal(signal.SIGCONT)


async def trainer_after_the_marker_before_reading_it(run: FiniteRun) -> None:
    # the engine holds (nothing generated) until the trainer is up and frozen; then the rollout,
    # its quota never binding, plays its data out and publishes the marker the trainer cannot read
    await wait_for(lambda: "trainer ready" in run.child("trainer").log_path.read_text(errors="replace"), REACH_S,
                   "the trainer ready", procs=[run.child("trainer")])
    run.child("trainer").signal(signal.SIGSTOP)
    assert not await run.marker_stored() and run.published() == 0  # the precondition
    run.release("local_engine.step")
    await wait_for(run.marker_stored, REACH_S, "the marker in the stream", procs=[run.child("rollout")])
    await kill_and_restart_trainer(run)


async def trainer_while_the_last_step_is_assembled(run: FiniteRun) -> None:
    run.arm(f"trainer.step.{LAST_STEP}")
    await run.reached(f"trainer.step.{LAST_STEP}")
    await kill_and_restart_trainer(run)


async def trainer_during_the_last_sync(run: FiniteRun) -> None:
    run.arm(f"trainer.step.{LAST_STEP}")
    await run.reached(f"trainer.step.{LAST_STEP}")
    run.arm("trainer.sync_bucket")
    run.release(f"trainer.step.{LAST_STEP}")
    await run.reached("trainer.sync_bucket")
    await kill_and_restart_trainer(run)


async def trainer_between_checkpoints_rollout_ahead(run: FiniteRun) -> None:
    """Issue 65: the trainer SIGKILLed at step 8, between its checkpoints 6 and 9, once the
    rollout has gone as far ahead as it can (its quota used, its queue full or its data all
    started; everything it started published, the marker maybe stored). The
    restarted trainer resumes from step 6, jumps its version past the engines' and finds whole
    groups generated on the lost steps' weights too stale: it drops them, then must still reach
    the end of the data (the rollout refilling what was dropped) and account for every one."""
    run.arm("trainer.step.8")
    await run.reached("trainer.step.8")  # step 7 committed, checkpoint 6 the newest

    async def rollout_as_far_as_it_goes() -> bool:  # admission blocked (quota, queue or data), nothing in flight
        status = await get_json(f"{run.stack.urls['rollout']}/admin/status", run.stack.doc["security"]["admin_token"])
        blocked = status.get("admission_blocked") or ""
        return any(why in blocked for why in ("staleness quota used", "queue full", "prompt stream exhausted")) and \
            status["counts"]["in_flight_samples"] == 0

    await wait_for(rollout_as_far_as_it_goes, REACH_S, "the rollout blocked by its quota, its queue or its data, nothing in flight",
                   procs=[run.child("rollout")])
    assert run.step() == 7 and run.published() > 8 * PER_STEP  # the precondition: the rollout is ahead of the held step 8
    await kill_and_restart_trainer(run)


async def rollout_near_the_end(run: FiniteRun) -> None:
    await run.at_step(6)
    run.child("trainer").signal(signal.SIGSTOP)
    assert not await run.marker_stored()
    await asyncio.to_thread(run.child("rollout").kill)
    run.restart("rollout")
    run.child("trainer").signal(signal.SIGCONT)


async def nats_near_the_end(run: FiniteRun) -> None:
    await run.at_step(6)
    run.child("trainer").signal(signal.SIGSTOP)
    assert not await run.marker_stored()
    await asyncio.to_thread(run.stack.nats.kill)
    await asyncio.to_thread(run.stack.nats.start)
    run.child("trainer").signal(signal.SIGCONT)


async def no_fault(run: FiniteRun) -> None:
    return None


async def rollout_mid_per_request_decision(run: FiniteRun) -> None:
    """Issue 51: the rollout service SIGKILLed inside a per-request pause, its calls judged and
    the cancelled ones marked but nothing aborted yet; started again, the run must finish (no
    engine or rollout left paused) with every trajectory trained or dropped once."""
    await run.at_step(3)
    run.arm("rollout.per_request_decided")
    await wait_for(lambda: failpoints.reached(run.fp, "rollout.per_request_decided"), REACH_S,
                   "a per-request pause to decide", procs=[run.child("rollout")])
    await asyncio.to_thread(run.child("rollout").kill)
    run.disarm_all()
    run.restart("rollout")


FAULTS = {
    # issue 51: per-request pauses (cancels published as stale_cancelled, exact-rid aborts) keep
    # the run's accounting whole: every trajectory trained or dropped once, none lost
    "per-request-pauses": (no_fault, ("async_training.partial_rollout=true", "async_training.staleness_threshold=0.5",
                                      "sync.pause_policy=per_request")),
    "per-request-rollout-killed-mid-decision": (rollout_mid_per_request_decision,
                                                ("async_training.partial_rollout=true", "async_training.staleness_threshold=0.5",
                                                 "sync.pause_policy=per_request")),
    "trainer-before-last-publish": (trainer_before_the_last_publish, ()),
    # a quota that never binds: the rollout finishes while the trainer is frozen
    "trainer-marker-unread": (trainer_after_the_marker_before_reading_it, ("async_training.staleness_threshold=100",)),
    "trainer-last-step-assembled": (trainer_while_the_last_step_is_assembled, ()),
    "trainer-last-sync": (trainer_during_the_last_sync, ()),
    "trainer-between-checkpoints-rollout-ahead": (trainer_between_checkpoints_rollout_ahead, ("rollout.quota_starvation_s=5",)),
    "rollout-near-end": (rollout_near_the_end, ()),
    "nats-near-end": (nats_near_the_end, ()),
}
SLICE = ("trainer-marker-unread", "trainer-between-checkpoints-rollout-ahead")
HOLD_ENGINE = ("trainer-marker-unread",)


@pytest.mark.parametrize("fault", [pytest.param(f, marks=[pytest.mark.endings_slice] if f in SLICE else [])
                                   for f in FAULTS])
async def test_a_finite_run_trains_or_drops_every_trajectory_after_a_fault_near_its_end(tmp_path, fault):
    strike, extra = FAULTS[fault]
    async with finite_run(tmp_path, *extra, hold_engine=fault in HOLD_ENGINE) as run:
        await strike(run)
        await finish_and_audit(run)


if __name__ == "__main__":  # pragma: no cover - a manual run of one fault
    sys.exit(pytest.main([__file__, "-k", sys.argv[1] if len(sys.argv) > 1 else ""]))
