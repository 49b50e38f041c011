"""``asyncrl up`` as a user runs it: a subprocess, a small config, real children.

It must run to ``total_rollout_steps`` and stop by itself with a summary and a plot; and when
a child dies, stop with exit status 1 and the tail of that
child's log, instead of hanging. In every case no child process may outlive it. Ctrl-C, and ``./dev up`` exactly as the README
types it: tests/front_door/test_dev_up.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.processes import processes_mentioning
from tests.helpers.user_runs import children_left
from tests.helpers.waiting import wait_for_sync

UP_LIMIT_S = 240.0


def up_args(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "launcher", "up", "--no-live",
        f"run.dir={run_dir}", "run.id=up-test", "model.path=builtin:tiny", "model.max_model_len=512",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "rollout.tools=[]", "rollout.sampling.max_new_tokens=32",
        "rollout.response_length=32", "engines.num_local=1", "trainer.nproc_per_node=1", "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.checkpoint.save_freq=0", *extra,
    ]


def start_up(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(up_args(run_dir, *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout_s: float = UP_LIMIT_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"asyncrl up did not stop within {timeout_s:.0f} s\n{out[-3000:]}\n{err[-3000:]}") from None
    return proc.returncode, out, err


def wait_for_file_text(path: Path, needle: str, timeout_s: float, proc: subprocess.Popen) -> None:
    def appeared() -> bool:
        if path.exists() and needle in path.read_text(errors="replace"):
            return True
        assert proc.poll() is None, f"asyncrl up exited early: {proc.communicate()}"
        return False

    wait_for_sync(appeared, timeout_s, f"{needle!r} to appear in {path}", interval_s=0.5)


def test_up_runs_to_total_rollout_steps_and_writes_the_summary(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, err = finish(start_up(run_dir, "rollout.total_rollout_steps=4"))
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert "the trainer finished its steps" in out
    # where to look, printed once the services are up: the run dir and live endpoints
    assert f"run dir   {run_dir.resolve()}" in out and "Ctrl-C" in out
    metrics = re.findall(r"(http://127\.0\.0\.1:\d+)/metrics \((\w+)", out)
    assert {name for _, name in metrics} == {"rollout", "trainer", "sync"}, out[-3000:]
    assert re.search(r"^run health: (starting|progressing|finished)", out, re.M), out[-3000:]  # the health block, shown
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 2 and summary["syncs"] >= 1 and summary["syncs_failed"] == 0, summary
    assert summary["reward_first"] is not None
    png = run_dir / "summary.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for child in ("nats", "engine-0", "rollout", "sync-agent", "trainer"):
        assert (run_dir / "logs" / f"{child}.log").stat().st_size > 0, child
    assert (run_dir / "config.yaml").stat().st_mode & 0o077 == 0, "the config with tokens is private"
    resolved = (run_dir / "config.resolved.yaml").read_text()
    token = yaml.safe_load((run_dir / "config.yaml").read_text())["security"]["admin_token"]
    assert token and token not in resolved, "config.resolved.yaml masks secrets"
    rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert children_left(run_dir) == []
    # issue 48 item 5: the run is its user's alone (the answer key in data/, trajectories, the store)
    loose = [f"{p.relative_to(run_dir)} {oct(p.lstat().st_mode & 0o777)}" for p in [run_dir, *run_dir.rglob("*")]
             if not p.is_symlink() and p.lstat().st_mode & 0o077]
    assert loose == [], loose[:20]
    assert (run_dir / "data" / "train.jsonl").is_file()


def test_up_trains_on_a_verifiers_environment(tmp_path):
    """``data.source = "verifiers:..."``: asyncrl up's rollout service starts the driver itself,
    the trainer trains on its episodes, and the driver does not outlive the run."""
    run_dir = tmp_path / "run"
    rc, out, err = finish(start_up(run_dir, "rollout.total_rollout_steps=4", "data.source=verifiers:tests.rollout.verifiers_arith",
                                   'data.source_options={"kind": "single", "rows_n": 8}'))
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 2 and summary["syncs_failed"] == 0, summary
    progress = json.loads((run_dir / "rollout" / "verifiers" / "progress.json").read_text())
    assert progress["env_id"] == "tests.rollout.verifiers_arith" and progress["started"] >= 4 and progress["errors"] == 0, progress
    assert "verifiers environment tests.rollout.verifiers_arith" in (run_dir / "rollout" / "verifiers" / "driver.log").read_text()
    assert children_left(run_dir) == []


def test_up_stops_with_the_log_tail_when_a_child_dies(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_up(run_dir, "rollout.total_rollout_steps=100000")
    wait_for_file_text(run_dir / "metrics" / "trainer.jsonl", '"step": 1', UP_LIMIT_S, proc)
    doc = yaml.safe_load((run_dir / "config.yaml").read_text())
    port = doc["engines"]["urls"][0].rsplit(":", 1)[1]
    engines = processes_mentioning(f"--port {port}")
    assert len(engines) == 1, engines
    os.kill(int(engines[0].split(":")[0]), signal.SIGKILL)
    rc, out, err = finish(proc, 120)
    assert rc == 1, f"{out[-3000:]}\n{err[-3000:]}"
    assert "engine-0 exited with code -9" in err and "last log lines" in err
    last_line = (run_dir / "logs" / "engine-0.log").read_text().strip().splitlines()[-1]
    assert last_line in err, "the tail of the dead child's log is shown"
    assert children_left(run_dir) == []


def test_up_refuses_an_unknown_builtin_model_before_starting_anything(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, err = finish(start_up(run_dir, "model.path=builtin:nope"), 120)
    assert rc == 2 and "unknown builtin model 'builtin:nope'" in err, (out[-2000:], err[-2000:])
    assert not (run_dir / "logs").exists()  # no child was started
