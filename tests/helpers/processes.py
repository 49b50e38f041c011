"""Real local_engine processes for tests: a free (or given) loopback port, bounded startup,
stopped by the test.

``start_engine(log_dir, *extra, model=..., port=..., api_key=..., admin_api_key=..., env=...,
name=...)`` runs ``python -m local_engine --model MODEL --seed 0 --host 127.0.0.1 --port P
--torch-threads 1 --log-level L *extra`` and returns an :class:`Engine` once ``/health``
answers; a failed start raises with the log tail. Use it as a context manager (stopped at
exit) or call ``engine.stop()``. ``extra``: more engine flags (``--sglang-compat 0.5.18``,
``--max-batch-size 2``); ``port``: a fixed port, e.g. to restart an engine where it was;
``api_key`` / ``admin_api_key``: set through ``$LOCAL_ENGINE_API_KEY`` /
``$LOCAL_ENGINE_ADMIN_API_KEY`` (keys in this process's environment never leak in);
``env``: more environment variables (e.g. SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT``). The
log level is ``$LOCAL_ENGINE_TEST_LOG_LEVEL`` or ``warning``; the log is
``<log_dir>/<name>-<port>.log``.

``processes_mentioning(*needles)``: the command lines of live processes that contain any of
them (what a run left behind).
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from asyncrl.launch import ChildProcess, http_ok

# Importing torch + transformers and building the model takes 5-15 s on a busy 2-core box.
ENGINE_START_TIMEOUT_S = 120.0
# Per-call limit the tests' clients use: generous for a loaded CI box, still bounded.
CLIENT_TIMEOUT_S = 60.0
MODEL = "builtin:tiny"
SEED = 0


@dataclass
class Engine:
    """A running engine: its URL, keys and process."""

    url: str
    port: int
    proc: ChildProcess
    api_key: str | None = None
    admin_api_key: str | None = None

    def client(self, **kw):
        from asyncrl.engine_client import EngineClient

        kw.setdefault("request_timeout_s", CLIENT_TIMEOUT_S)
        kw.setdefault("control_timeout_s", CLIENT_TIMEOUT_S)
        return EngineClient(self.url, api_key=self.api_key, admin_api_key=self.admin_api_key, **kw)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after a grace period; the exit code."""
        return self.proc.stop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_engine(log_dir: Path | str, *extra: str, model: str = MODEL, port: int | None = None, api_key: str | None = None,
                 admin_api_key: str | None = None, env: dict[str, str] | None = None, name: str = "engine") -> Engine:
    """Start a local_engine and wait for ``/health`` (module docstring). Without ``port`` the
    engine claims a free one itself (``--port 0 --addr-file``) and says which: a port drawn here
    and bound there later could meanwhile go to another test's server (a NATS server once
    answered this readiness probe)."""
    addr_file = None
    if port is None:
        addr_file = Path(log_dir) / f"{name}-{uuid.uuid4().hex[:8]}.addr"
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "local_engine", "--model", model, "--seed", str(SEED), "--host", "127.0.0.1",
            "--port", str(port or 0), *(["--addr-file", str(addr_file)] if addr_file else []), "--torch-threads", "1",
            "--log-level", os.environ.get("LOCAL_ENGINE_TEST_LOG_LEVEL", "warning"), *extra]
    child_env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_ENGINE_API_KEY", "LOCAL_ENGINE_ADMIN_API_KEY")}
    if api_key:
        child_env["LOCAL_ENGINE_API_KEY"] = api_key
    if admin_api_key:
        child_env["LOCAL_ENGINE_ADMIN_API_KEY"] = admin_api_key
    child_env.update(env or {})
    label = f"{name}-{port}" if addr_file is None else addr_file.stem
    proc = ChildProcess(name, argv, Path(log_dir) / f"{label}.log", env=child_env).start()
    try:
        if addr_file is not None:
            proc.wait_ready(addr_file.exists, ENGINE_START_TIMEOUT_S, "did not claim a port")
            port = int(addr_file.read_text().strip().rsplit(":", 1)[1])
        url = f"http://127.0.0.1:{port}"
        proc.wait_ready(lambda: http_ok(f"{url}/health"), ENGINE_START_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    return Engine(url=url, port=port, proc=proc, api_key=api_key, admin_api_key=admin_api_key)


def process_tree(pid: int) -> list:
    """``pid`` and all its descendants as ``psutil.Process`` (empty once it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(tree: list) -> list[int]:
    """Pids of ``tree`` still running (zombies count as gone)."""
    import psutil

    out = []
    for p in tree:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def processes_mentioning(*needles: str) -> list[str]:
    """Command lines of live processes that contain any of ``needles``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in needles):
            found.append(f"{pid}: {cmd}")
    return found
