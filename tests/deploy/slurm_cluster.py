"""A real one-node Slurm cluster for tests: Debian's ``slurm-wlm`` and ``munge``, started as
root in a directory of the test's own.

``SlurmCluster(workdir).start()`` writes a munge key and a ``slurm.conf`` (this host as the
one node, 16 CPUs declared — ``SlurmdParameters=config_overrides`` lets a small machine
hold a job's steps that share CPUs with ``--overlap`` anyway —, free ports, its own state and
spool directories, no accounting), starts ``munged``, ``slurmctld`` and ``slurmd``, and waits
until the node is idle. Every Slurm command of the test must see ``SLURM_CONF``: use
:attr:`env`. ``stop()`` cancels what is left and stops the daemons.

:func:`missing` names what this machine lacks (binaries, root) for the tests to skip on.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from asyncrl.launch import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
KILL_WAIT_S = 30  # Slurm's default: SIGTERM, then SIGKILL this long after (scancel, time limit)


def missing() -> str | None:
    absent = [b for b in (*DAEMONS, "sbatch", "scontrol", "scancel") if shutil.which(b) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install slurm-wlm munge; ./dev test-slurm does it)"
    if os.geteuid() != 0:
        return "the test cluster's daemons run as root"
    return None


def _which(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} not found"
    return path


class SlurmCluster:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.node = socket.gethostname().split(".")[0]
        self.conf = workdir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: dict[str, Path] = {}

    def _config(self) -> str:
        d = self.dir
        return "\n".join([
            "ClusterName=asyncrltest", f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={d / 'munge.sock'}", "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "ReturnToService=2", f"KillWait={KILL_WAIT_S}", "MinJobAge=3600",
            "SlurmdParameters=config_overrides", "PlugStackConfig=/dev/null", "SchedulerParameters=sched_interval=1",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs=16 RealMemory=16000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", "",
        ])

    def start(self) -> "SlurmCluster":
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o600)
        self.conf.write_text(self._config())
        subprocess.run([_which("munged"), f"--socket={d / 'munge.sock'}", f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                        f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munge.seed'}", "--force"], check=True, env=self.env)
        self.pids["munged"] = d / "munged.pid"
        subprocess.run([_which("slurmctld"), "-i"], check=True, env=self.env)
        self.pids["slurmctld"] = d / "slurmctld.pid"
        subprocess.run([_which("slurmd")], check=True, env=self.env)
        self.pids["slurmd"] = d / "slurmd.pid"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run("sinfo", "--noheader", "--format=%t", check=False)
            if out.returncode == 0 and out.stdout.strip() == "idle":
                return self
            time.sleep(0.5)
        raise AssertionError(f"the test cluster's node did not become idle: {out.stdout} {out.stderr}\n"
                             f"{(d / 'slurmctld.log').read_text()[-2000:]}\n{(d / 'slurmd.log').read_text()[-2000:]}")

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr}")
        return out

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "--oneliner", "show", "job", job_id)
        return next(f.split("=", 1)[1] for f in out.stdout.split() if f.startswith("JobState="))

    def wait_job_end(self, job_id: str, timeout_s: float) -> str:
        """The job's final state (COMPLETED, FAILED, CANCELLED, ...) once it left the queue."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED"):
                return state
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {state} after {timeout_s:.0f} s")

    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        for name in reversed(DAEMONS):
            pid_file = self.pids.get(name)
            if pid_file and pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(1)
