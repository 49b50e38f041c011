"""Issue 48 items 4 and 6, on ``asyncrl slurm``'s files (no Slurm needed):

- a newline (or any whitespace or control character) in ``run.dir`` used to inject shell lines
  into job.sbatch: the command refuses it, naming the setting, and writes nothing;
- the run directory, its ``logs`` (where Slurm writes every step's output, SGLang's server args
  with the api key among them) and the script are the user's alone (0700);
- a failing service's log tail copied into the job's output has every secret redacted.
"""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

from pydantic import SecretStr

from asyncrl.config import load_config
from asyncrl.config.secrets import redact, secret_values

REPO = Path(__file__).resolve().parents[2]


def _slurm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", "slurm", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_a_run_dir_that_would_inject_lines_into_the_script_is_refused(tmp_path):
    for bad in ("x\ntouch /tmp/pwned", "with space", "tab\there"):
        run_dir = tmp_path / bad
        out = _slurm(f"run.dir={run_dir}")
        assert out.returncode == 2 and "run.dir" in out.stderr and "whitespace or a control character" in out.stderr, out
        assert not run_dir.exists() and not (tmp_path / "x").exists()


def test_the_run_dir_its_logs_and_the_script_are_private(tmp_path):
    run_dir = tmp_path / "run"
    out = _slurm(f"run.dir={run_dir}")
    assert out.returncode == 0, out.stderr
    for path in (run_dir, run_dir / "logs", run_dir / "slurm", run_dir / "slurm" / "job.sbatch", run_dir / "slurm" / "run.yaml"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))


def test_log_tails_are_redacted_of_every_configured_secret():
    cfg = load_config(overrides=["engines.api_key=engine-key-0123456789", "security.admin_token=admin-token-0123456789"],
                      environ={})
    values = secret_values(cfg)
    assert "engine-key-0123456789" in values and "admin-token-0123456789" in values
    log = "server_args=ServerArgs(api_key='engine-key-0123456789', admin_api_key=None)\nadmin-token-0123456789 seen"
    clean = redact(log, values)
    assert "engine-key-0123456789" not in clean and "admin-token-0123456789" not in clean and clean.count("[redacted]") == 2
    assert isinstance(cfg.engines.api_key, SecretStr)


def test_the_job_driver_copies_a_failing_services_log_tail_redacted(tmp_path):
    from asyncrl.launch import ChildProcess
    from launcher.slurm.job import SlurmJob as Job
    from launcher.slurm.placement import place

    cfg = load_config(overrides=[f"run.dir={tmp_path / 'run'}", "engines.api_key=engine-key-0123456789"], environ={})
    job = Job(cfg, place(cfg, ["n1"]))
    job.resolve()
    generated = job.doc["security"]["sync_token"]
    log = tmp_path / "engine.log"
    log.write_text(f"server_args api_key='engine-key-0123456789' sync={generated}\nTraceback: boom\n")
    message = job._exit_message("engine-0", ChildProcess("engine-0", ["true"], log), "exited")
    assert "boom" in message and "engine-key-0123456789" not in message and generated not in message
