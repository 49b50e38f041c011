"""Parent side of the python sandbox: start one isolated run, capture it, kill what is left.

``await run_isolated(spec)`` starts :mod:`tools._sandbox_launcher` in a new session (its
own process group) with an empty environment, in ``spec.workdir``, with stdout/stderr on
pipes; waits at most ``spec.wall_timeout_s``; then, however the run ended (exit, timeout,
cancellation of the awaiting task), it

1. kills the process group with SIGKILL (children that stayed in the group);
2. when the run had its own uid, finds every live process of that uid in ``/proc`` and
   kills them all at once with ``kill(-1, SIGKILL)`` sent *as that uid* (children that
   left the group with ``setsid``; the uid is unique to the run, so nothing else dies).
   It repeats this up to ``SWEEP_ROUNDS`` times and reports what it found;
3. stops reading the pipes (each kept to its first and last bytes by :class:`CappedOutput`,
   so a program printing gigabytes costs the parent a bounded amount of memory).

Deleting ``spec.workdir`` is the caller's job (after this returns or raises).

(With a pid namespace the kernel has already killed everything when the launcher exits;
steps 1-2 then find nothing.)

Not covered: with neither a per-run uid nor a pid namespace (a normal user in the
audit-hook fallback), processes that leave the process group (``setsid``, double fork)
survive the run, bounded only by their own RLIMIT_CPU. The uid is derived from the
launcher's pid after it was reaped: pid reuse within the milliseconds before the sweep
would be needed to hit another run. Zombies are not counted as survivors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools._sandbox_launcher import REPORT_MARKER

logger = logging.getLogger(__name__)

LAUNCHER_PATH = str(Path(__file__).with_name("_sandbox_launcher.py"))
READ_CHUNK_BYTES = 64 * 1024
REAP_TIMEOUT_S = 5.0  # SIGKILLed processes exit in milliseconds; this only bounds a bug
PIPE_DRAIN_TIMEOUT_S = 1.0  # after the kill, pipes hit EOF at once unless a survivor holds them
EXIT_POLL_S = 0.01  # see _wait_for_exit; adds at most this much latency to a run
SWEEP_ROUNDS = 3  # kill(-1) is atomic w.r.t. fork; extra rounds only cover odd races
_KILL_ALL_OF_MY_UID = "import os, signal; os.kill(-1, signal.SIGKILL)"


@dataclass(frozen=True)
class RunSpec:
    """Everything one isolated run needs (built by :class:`tools.python_sandbox.PythonSandbox`)."""

    workdir: str
    interpreter: str  # runs main.py in the sandbox; must be usable by the run's uid
    wall_timeout_s: float
    rlimits: dict[str, tuple[int, int]]
    network: str  # "auto" | "namespace" | "audit_hook"
    pid_namespace: bool  # run the program under an init in a new pid namespace
    max_processes: int  # RLIMIT_NPROC, set by the launcher (see _process_limit there)
    uid_tasks: int | None  # tasks of the service's uid now; None with a per-run uid
    uid_base: int | None  # run's uid = uid_base + launcher pid; None: keep the service's uid
    max_output_bytes: int
    hidden: tuple[str, ...] = ()  # directories the program must not see (an empty tmpfs over each, root mode)


@dataclass
class RunOutcome:
    """How a run ended: exit status, captured output, and the isolation the launcher reported."""

    returncode: int | None
    timed_out: bool
    wall_s: float  # from start until the program exited or was stopped (cleanup excluded)
    wall_limit_s: float
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    report: dict[str, Any] = field(default_factory=dict)
    survivors_killed: int = 0  # processes of the run's uid found alive after it ended
    survivors_left: int = 0  # ... and still alive after the sweep (should be 0)


class CappedOutput:
    """Keeps the first ``head`` and last ``tail`` bytes of a stream and counts the rest."""

    def __init__(self, limit_bytes: int) -> None:
        self.head_limit = limit_bytes // 2
        self.tail_limit = limit_bytes - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    def text(self) -> str:
        omitted = self.total - len(self.head) - len(self.tail)
        middle = f"\n[... {omitted} bytes omitted ...]\n".encode() if omitted else b""
        return bytes(self.head + middle + self.tail).decode("utf-8", errors="replace")


async def _drain(stream: asyncio.StreamReader, sink: CappedOutput) -> None:
    while chunk := await stream.read(READ_CHUNK_BYTES):
        sink.feed(chunk)


async def _drain_stderr(
    stream: asyncio.StreamReader, sink: CappedOutput, report: dict[str, Any]
) -> None:
    """Parse the launcher's report lines (they precede any model output), then drain."""
    marker = REPORT_MARKER.encode()
    with contextlib.suppress(ValueError):  # an over-long first line: no report, keep draining
        for _ in range(2):  # the report, plus one more if execve failed
            line = await stream.readline()
            if not line.startswith(marker):
                sink.feed(line)
                break
            with contextlib.suppress(ValueError):
                report.update(json.loads(line[len(marker) :]))
    await _drain(stream, sink)


def _tasks_by_pid_of_uid(uid: int) -> dict[int, int]:
    """{pid: thread count} of non-zombie processes whose real uid is ``uid`` (``/proc``)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as status:
                fields = dict(line.split(b":", 1) for line in status if b":" in line)
        except OSError:
            continue  # exited meanwhile
        real_uid = int(fields.get(b"Uid", b"-1").split()[0])
        if real_uid == uid and not fields.get(b"State", b"").strip().startswith(b"Z"):
            found[int(entry)] = int(fields.get(b"Threads", b"1"))
    return found


def live_pids_of_uid(uid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose real uid is ``uid``."""
    return sorted(_tasks_by_pid_of_uid(uid))


async def sweep_uid(uid: int, interpreter: str) -> tuple[int, int]:
    """Kill every process of ``uid``; returns (found alive at first, still alive at the end)."""
    found = survivors = len(await asyncio.to_thread(live_pids_of_uid, uid))
    for _ in range(SWEEP_ROUNDS if found else 0):
        killer = await asyncio.create_subprocess_exec(
            interpreter,
            "-I",
            "-S",
            "-c",
            _KILL_ALL_OF_MY_UID,
            user=uid,
            group=uid,
            extra_groups=[],
            env={},
            cwd="/",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await asyncio.wait_for(killer.wait(), REAP_TIMEOUT_S)
        except TimeoutError:
            killer.kill()
        survivors = len(await asyncio.to_thread(live_pids_of_uid, uid))
        if not survivors:
            break
    if survivors:
        logger.error("sandbox uid %d: %d processes survived the sweep", uid, survivors)
    return found, survivors


async def _wait_for_exit(proc: asyncio.subprocess.Process) -> None:
    """Wait until the process itself has exited.

    Not ``proc.wait()``: on Python 3.11 that also waits until every holder of its stdout and
    stderr closes them, i.e. until its children (which inherit the pipes) exit too.
    ``returncode`` is set as soon as the child watcher reaps the process.
    """
    while proc.returncode is None:
        await asyncio.sleep(EXIT_POLL_S)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _launch_config(spec: RunSpec) -> str:
    return json.dumps({
        "interpreter": spec.interpreter,
        "rlimits": spec.rlimits,
        "network": spec.network,
        "pid_namespace": spec.pid_namespace,
        "max_processes": spec.max_processes,
        "uid_tasks": spec.uid_tasks,
        "uid_base": spec.uid_base,
        "hidden": list(spec.hidden),
    })


def probe_isolation(spec: RunSpec) -> dict[str, Any]:
    """Run ``spec.workdir``'s ``main.py`` (a trivial program) under the launcher, blocking,
    and return the isolation it reported (with ``setup_error`` if it refused). For the tool's
    start-up check: the same launcher and settings as every run."""
    proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER_PATH, _launch_config(spec)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=spec.workdir, env={}, start_new_session=True)
    try:
        _out, err = proc.communicate(timeout=spec.wall_timeout_s)
    except subprocess.TimeoutExpired:
        err = b""
    finally:
        _kill_group(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        if spec.uid_base is not None:  # nothing of the probe may outlive it
            for pid in live_pids_of_uid(spec.uid_base + proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
    marker = REPORT_MARKER.encode()
    for line in err.splitlines():
        if line.startswith(marker):
            with contextlib.suppress(ValueError):
                return json.loads(line[len(marker):])
    return {"setup_error": f"no isolation report (exit {proc.returncode}): {err[-300:].decode(errors='replace')}"}


async def run_isolated(spec: RunSpec) -> RunOutcome:
    """Run ``main.py`` in ``spec.workdir`` under the launcher; see the module docstring."""
    loop = asyncio.get_running_loop()
    stdout, stderr = CappedOutput(spec.max_output_bytes), CappedOutput(spec.max_output_bytes)
    report: dict[str, Any] = {}
    started = loop.time()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-S",
        LAUNCHER_PATH,
        _launch_config(spec),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=spec.workdir,
        env={},
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    readers = [
        asyncio.create_task(_drain(proc.stdout, stdout)),
        asyncio.create_task(_drain_stderr(proc.stderr, stderr, report)),
    ]
    timed_out = False
    found = left = 0
    try:
        try:
            await asyncio.wait_for(_wait_for_exit(proc), spec.wall_timeout_s)
        except TimeoutError:
            timed_out = True
        ended = loop.time()
    finally:  # also on cancellation: nothing of the run may outlive this call
        _kill_group(proc.pid)  # start_new_session: the launcher's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_wait_for_exit(proc), REAP_TIMEOUT_S)
        if spec.uid_base is not None:
            found, left = await sweep_uid(spec.uid_base + proc.pid, spec.interpreter)
        _, pending = await asyncio.wait(readers, timeout=PIPE_DRAIN_TIMEOUT_S)
        for reader in pending:  # a survivor still holds a pipe (only possible without a uid)
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        transport = getattr(proc, "_transport", None)  # close our pipe ends even then
        if transport is not None:
            transport.close()
    return RunOutcome(
        returncode=proc.returncode,
        timed_out=timed_out,
        wall_s=ended - started,
        wall_limit_s=spec.wall_timeout_s,
        stdout=stdout.text(),
        stderr=stderr.text(),
        stdout_bytes=stdout.total,
        stderr_bytes=stderr.total,
        report=report,
        survivors_killed=found,
        survivors_left=left,
    )
