"""The README's first command as a user types it: ``./dev up``, the shipped demo config, no
overrides but ``run.dir`` (the README's way of giving a second run its own directory).

Two runs start at once on this machine and each trains (≥ 5 steps, ≥ 3 syncs succeeded), is
stopped with Ctrl-C (SIGINT to its whole process group, as a terminal sends it), exits 0 with
a summary that says so, and leaves no process behind; a third on the first's directory is
refused while the first trains on. The README's examples: ``test_readme_examples.py``.

Every earlier test of ``asyncrl up`` passed ``rollout.port=0 sync.port=0
trainer.metrics_port=0``; the command a user types failed at once for a week (issue 64).
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.user_runs import DevUp, children_left

START_AND_TRAIN_S = 420.0  # install check, the services' start and five steps, two runs beside the other tests
STOP_S = 90.0  # Ctrl-C → every child stopped (the trainer writes its checkpoint within trainer.stop_timeout_s)


@pytest.mark.timeout(START_AND_TRAIN_S + STOP_S + 120)
def test_two_dev_up_demo_runs_at_once_train_and_stop_on_ctrl_c(tmp_path):
    runs = [DevUp.start(tmp_path / name) for name in ("first", "second")]
    try:
        for run in runs:
            run.wait_until(lambda r=run: r.steps() >= 5 and r.syncs_succeeded() >= 3, START_AND_TRAIN_S,
                           "5 trainer steps and 3 syncs")
        # a third on the first's directory is refused (one line, exit 2) and the first trains on
        third = DevUp.start(runs[0].run_dir)
        rc, out = third.finish(STOP_S)
        lines = [line for line in out.splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1, out[-4000:]
        assert f"run directory {runs[0].run_dir} is in use by another asyncrl up or demo-stack (pid {runs[0].proc.pid})" in lines[0], lines
        before = runs[0].steps()
        runs[0].wait_until(lambda: runs[0].steps() > before, START_AND_TRAIN_S, "a step after the refused third run")
        for run in runs:
            run.ctrl_c()
        for run in runs:
            rc, out = run.finish(STOP_S)
            assert rc == 0, out[-4000:]
            assert "stopping: interrupted" in out, out[-4000:]
            summary = run.summary()
            assert summary["stopped_because"] == "interrupted", summary
            assert summary["trainer_steps"] >= 5 and summary["syncs"] >= 3 and summary["syncs_failed"] == 0, summary
            assert summary["reward_first"] is not None and 0.0 <= summary["reward_first"] <= 1.0, summary
            assert children_left(run.run_dir) == []
        ports = [set(re.findall(r"http://127\.0\.0\.1:(\d+)/metrics", run.text())) for run in runs]
        assert len(ports[0]) == 3 and not ports[0] & ports[1], ports  # each run's own rollout, trainer and sync ports
    finally:
        for run in runs:
            run.kill()
