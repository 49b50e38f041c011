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


def test_each_job_has_an_engine_admin_key_of_its_own_and_the_engines_get_it_privately(tmp_path):
    """Issue 48 item 4: a data-plane key that outlives the job (configured) cannot pause or reload
    this job's engines: the admin routes get a key generated for the job, which reaches SGLang
    through the step's private config file and a local engine through its environment."""
    from launcher.slurm.job import SlurmJob as Job
    from launcher.slurm.placement import place
    from launcher.slurm.steps import ENGINE_ADMIN_KEY_ENV, engine_command

    overrides = [f"run.dir={tmp_path / 'run'}", "engines.api_key=engine-key-0123456789"]
    cfg = load_config(overrides=overrides, environ={})
    first, second = Job(cfg, place(cfg, ["n1"])), Job(cfg, place(cfg, ["n1"]))
    keys = [first.resolve()["engines"]["admin_api_key"], second.resolve()["engines"]["admin_api_key"]]
    assert all(k and len(k) >= 24 for k in keys) and keys[0] != keys[1] and "engine-key-0123456789" not in keys
    assert keys[0] in first._secrets  # redacted from any log tail the job copies
    job_cfg = load_config(overrides=[*overrides, "engines.backend=sglang", f"engines.admin_api_key={keys[0]}"], environ={})
    cmd, env, opts = engine_command(job_cfg, "python3")
    assert opts == ["--secret-config=api-key=ASYNCRL_ENGINE_API_KEY", f"--secret-config=admin-api-key={ENGINE_ADMIN_KEY_ENV}"]
    assert env[ENGINE_ADMIN_KEY_ENV] == keys[0] and keys[0] not in " ".join(cmd)
    local_cfg = load_config(overrides=[*overrides, f"engines.admin_api_key={keys[0]}"], environ={})
    cmd, env, opts = engine_command(local_cfg, "python3")
    assert env["LOCAL_ENGINE_ADMIN_API_KEY"] == keys[0] and keys[0] not in " ".join(cmd) and opts == []


SERVICE = """
import json, os, socket, sys, time
path = sys.argv[sys.argv.index("--config") + 1]
read = json.load(open(path))
report = {"read": sorted(read), "dir": os.path.dirname(path)}
if sys.argv[1] == "listen":
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", int(sys.argv[2]))); srv.listen(8)
    deadline = time.monotonic() + 60
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    report["removed_while_serving"] = not os.path.exists(path)
print(json.dumps(report), flush=True)
"""


def _step_service(tmp_path: Path, mode: str) -> dict:
    import json
    import os

    from asyncrl.launch import free_port

    port = free_port("0.0.0.0")  # noqa: S104 - where the service listens
    out = subprocess.run([sys.executable, "-m", "launcher.slurm.step", f"--endpoint={tmp_path / 'endpoint.json'}",
                          f"--port={port}", "--secret-config=api-key=K1", "--secret-config=admin-api-key=K2", "--",
                          sys.executable, "-c", SERVICE, mode, str(port)], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={**os.environ, "K1": "data-key-0123456789", "K2": "admin-key-0123456789",
                                           "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gone(path: str, timeout_s: float = 30.0) -> bool:
    import os
    import time

    deadline = time.monotonic() + timeout_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_the_steps_secrets_file_is_removed_once_the_server_listens(tmp_path):
    """Issue 48 item 4: the per-step ``--config`` file with the engine keys is gone as soon as the
    server accepts connections (it read the file before), not left for the job's lifetime."""
    got = _step_service(tmp_path, "listen")
    assert got["read"] == ["admin-api-key", "api-key"] and got["removed_while_serving"] is True
    assert _gone(got["dir"])


def test_the_steps_secrets_file_is_removed_when_the_server_exits_before_listening(tmp_path):
    got = _step_service(tmp_path, "exit")
    assert got["read"] == ["admin-api-key", "api-key"]
    assert _gone(got["dir"]), "the watcher removes the file once the service is gone"
