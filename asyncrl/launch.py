"""Starting, watching and stopping child processes, and waiting for them to be ready.

Used by ``asyncrl up``, the embedded NATS server, the CLI and the tests. Every wait is
bounded; every child gets its own process group so stopping it stops its children too;
output goes to a log file whose tail is available when a child dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from asyncrl.listen_ports import free_port  # noqa: F401 - re-exported: launchers and tests take it from here

POLL_INTERVAL_S = 0.02  # readiness polls: a NATS server is up ~15 ms after exec
STOP_GRACE_S = 10.0  # SIGTERM → SIGKILL grace: long enough for uvicorn/NATS to flush


class ChildFailed(RuntimeError):
    """A child process exited (or never became ready); the message carries its log tail."""


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a TCP connect to ``host:port`` succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when GET ``url`` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback URLs we built
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(path: Path | str, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` of a log file ('' when it does not exist)."""
    p = Path(path)
    if not p.exists():
        return ""
    with open(p, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        return f.read().decode("utf-8", errors="replace")


class ChildProcess:
    """One child process with a log file, started in its own process group.

    ``wait_ready`` polls a readiness check until it passes, the child exits (raises
    :class:`ChildFailed` with the log tail) or the timeout passes. ``stop`` sends SIGTERM
    to the group, then SIGKILL after a grace period. Usable as a context manager.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path | str,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "ChildProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return None if self.proc is None else self.proc.poll()

    def failure(self, what: str) -> ChildFailed:
        code = self.poll()
        return ChildFailed(f"{self.name} {what} (exit code {code}); last log lines from {self.log_path}:\n{log_tail(self.log_path)}")

    def wait_ready(self, check, timeout_s: float, what: str = "did not become ready") -> None:
        """Poll ``check()`` until True; raise :class:`ChildFailed` on exit or timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.poll() is not None:
                raise self.failure("exited during startup")
            if check():
                return
            time.sleep(POLL_INTERVAL_S)
        raise self.failure(f"{what} within {timeout_s:.0f} s")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (no-op once it exited)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process group and reap the child (for crash tests)."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_GRACE_S)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.poll()

    def __enter__(self) -> "ChildProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
