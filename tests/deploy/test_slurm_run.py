"""``asyncrl slurm`` against a real Slurm: a one-node cluster of Debian's slurm-wlm and munge
(tests/deploy/slurm_cluster.py) runs the generated batch script for a small CPU run.

- submitted, the job places NATS, an engine, the rollout service, the sync agent and the
  trainer as job steps, trains to ``total_rollout_steps``, stops every service in order and
  ends COMPLETED, nothing left running; an engine killed mid-run is started again by the job;
- ``scancel`` mid-run leaves a checkpoint and the outbox, and submitting the same run again
  resumes and finishes with nothing lost or trained twice (``asyncrl audit``);
- the signal Slurm sends before the time limit (``--signal=B:USR1@N``) stops the job with a
  checkpoint and requeues it; its next start resumes and finishes;
- a service that dies (the sync agent) fails the job, whose output names it and its log.

Its own command (about 5 minutes, half of it Slurm's requeue delay; needs root to run the daemons): ``./dev test-slurm``, which
installs slurm-wlm and munge when they are missing. Under ``./dev test`` it is skipped unless
``ASYNCRL_SLURM_TESTS=1``; with it set, a machine without them skips naming what is missing.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.slurm_cluster import SlurmCluster, missing
from tests.helpers.processes import processes_mentioning
from tests.helpers.waiting import wait_for_sync

pytestmark = [pytest.mark.timeout(900)]

ENABLED = os.environ.get("ASYNCRL_SLURM_TESTS") == "1"
JOB_S = 400.0  # start (engine and services: ~25 s here), train, stop
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not ENABLED:
        pytest.skip("runs a real Slurm (slurmctld, slurmd, munge as root; ~5 min): its own command, ./dev test-slurm "
                    "(or ASYNCRL_SLURM_TESTS=1)")
    why = missing()
    if why:
        pytest.skip(f"cannot run Slurm here: {why}")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield c
    finally:
        c.stop()


def run_args(run_dir: Path, *extra: str) -> list[str]:
    return [f"run.dir={run_dir}", "run.id=slurm-test", "model.path=builtin:tiny", "model.max_model_len=512", "rollout.n=2",
            "actor.ppo_mini_batch_size=2", "rollout.tools=[]", "rollout.sampling.max_new_tokens=32", "rollout.response_length=32",
            "actor.ppo_micro_batch_size_per_gpu=4", "trainer.checkpoint.save_freq=0", *extra]


def submit(cluster: SlurmCluster, run_dir: Path, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher", "slurm", *run_args(run_dir, *extra), "--submit"],
                         capture_output=True, text=True, env=cluster.env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def job_output(run_dir: Path, job_id: str) -> str:
    path = run_dir / "logs" / f"slurm-{job_id}.out"
    return path.read_text() if path.exists() else ""


def trained_steps(run_dir: Path) -> int:
    path = run_dir / "metrics" / "trainer.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_output(run_dir: Path, job_id: str, needle: str, timeout_s: float = JOB_S) -> None:
    wait_for_sync(lambda: needle in job_output(run_dir, job_id), timeout_s, f"{needle!r} in the job's output")


def audit(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "launcher", "audit", str(run_dir), "--json"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def processes_of(run_dir: Path) -> list[str]:
    """Live processes started for the run: by its config path, or an engine by its port."""
    doc = yaml.safe_load((run_dir / "config.yaml").read_text())
    return processes_mentioning(str(run_dir), *(f"--port {u.rsplit(':', 1)[1]}" for u in doc["engines"]["urls"]))


def kill_service(run_dir: Path, needle: str) -> None:
    """SIGKILL the service process whose command line holds ``needle`` (not its srun or step wrapper)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(cmd).decode(errors="replace")
        if needle in text and "srun" not in text and "launcher.slurm.step" not in text:
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no process with {needle!r}")


def test_a_submitted_run_trains_to_the_end_and_survives_an_engine_crash(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, "rollout.total_rollout_steps=24")
    wait_for_sync(lambda: trained_steps(run_dir) >= 2, JOB_S, "two trainer steps")
    port = yaml.safe_load((run_dir / "config.yaml").read_text())["engines"]["urls"][0].rsplit(":", 1)[1]
    kill_service(run_dir, f"--port {port}")
    wait_output(run_dir, job, "engine-0 exited with code")
    assert cluster.wait_job_end(job, JOB_S) == "COMPLETED", job_output(run_dir, job)
    out = job_output(run_dir, job)
    assert "starting it again on its node and port (1 of 3)" in out, out
    assert "stopping: the trainer finished its steps" in out, out
    stops = re.findall(r"stopped ([\w-]+) \(exit code", out)
    assert stops == ["sync-agent", "rollout", "engine-0", "nats"], out  # reverse order of start (the trainer had exited)
    assert trained_steps(run_dir) == 12
    for name in ("nats", "engine-0", "rollout", "sync-agent", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    assert (run_dir / "config.yaml").stat().st_mode & 0o077 == 0, "the job's secrets are private"
    result = audit(run_dir)
    assert result["ok"] and result["lost"] == 0 and result["twice"] == 0 and result["trained"] == 48, result
    assert processes_of(run_dir) == []


def test_scancel_keeps_a_checkpoint_and_the_resubmitted_run_loses_nothing(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, "rollout.total_rollout_steps=60")
    wait_for_sync(lambda: trained_steps(run_dir) >= 3, JOB_S, "three trainer steps")
    cluster.run("scancel", job)
    assert cluster.wait_job_end(job, JOB_S) == "CANCELLED"
    before = trained_steps(run_dir)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert ckpts and int(ckpts[-1].split("-")[1]) >= 3, (ckpts, job_output(run_dir, job))  # written at the stop (save_freq=0)
    assert (run_dir / "rollout").is_dir()
    job2 = submit(cluster, run_dir, "rollout.total_rollout_steps=60")
    assert cluster.wait_job_end(job2, JOB_S) == "COMPLETED", job_output(run_dir, job2)
    assert "stopping: the trainer finished its steps" in job_output(run_dir, job2)
    rows = [json.loads(line) for line in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
    assert len(rows) > before and rows[-1]["step"] == 30, rows[-1]
    result = audit(run_dir)
    assert result["ok"] and result["lost"] == 0 and result["twice"] == 0 and result["lost_after_ack"] == 0, result
    assert result["trained"] + result["dropped"] == 120, result
    assert processes_of(run_dir) == []


def test_the_time_limit_signal_stops_requeues_and_the_job_resumes(cluster, tmp_path):
    """What ``--signal=B:USR1@N`` does before the time limit, sent now (``scancel --batch
    --signal=USR1``, as Slurm sends it) rather than waited for: the job stops with a
    checkpoint, requeues itself, and its next start (after Slurm's requeue delay, ~2 min)
    resumes and finishes."""
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, "rollout.total_rollout_steps=60")
    wait_for_sync(lambda: trained_steps(run_dir) >= 3, JOB_S, "three trainer steps")
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    wait_output(run_dir, job, "requeueing the job")
    wait_output(run_dir, job, "(start 2)", JOB_S)
    assert cluster.wait_job_end(job, JOB_S) == "COMPLETED", job_output(run_dir, job)
    out = job_output(run_dir, job)
    assert out.count("stopping: signal SIGUSR1") == 1 and "stopping: the trainer finished its steps" in out, out
    resumed = re.search(r"resumed from \S+step-(\d+)", (run_dir / "logs" / "trainer.log").read_text())
    assert resumed and int(resumed.group(1)) >= 3, "the second start resumed from the checkpoint the first wrote at its stop"
    result = audit(run_dir)
    assert result["ok"] and result["lost"] == 0 and result["twice"] == 0 and result["trained"] + result["dropped"] == 120, result
    assert processes_of(run_dir) == []


def test_a_dead_service_fails_the_job_naming_it_and_its_log(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, "rollout.total_rollout_steps=100000")
    wait_output(run_dir, job, "trainer started")
    kill_service(run_dir, "launcher sync-agent")
    assert cluster.wait_job_end(job, JOB_S) == "FAILED"
    out = job_output(run_dir, job)
    assert "the job failed: sync-agent exited (exit code" in out and f"its log: {run_dir / 'logs' / 'sync-agent.log'}" in out, out
    assert processes_of(run_dir) == []


def test_an_allocation_too_small_is_refused_before_submission(cluster, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "launcher", "slurm", *run_args(run_dir, "trainer.nnodes=2", "slurm.nodes=1"),
                          "--submit"], capture_output=True, text=True, env=cluster.env, cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert "slurm.nodes=1 but the placement needs 2 nodes" in out.stderr, out.stderr
    assert cluster.run("squeue", "--noheader").stdout.strip() == "" and not run_dir.exists()
