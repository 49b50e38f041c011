"""The ``python`` tool: run model-written code in a resource-limited, isolated subprocess.

**Defence in depth, not a security boundary.** The code runs as a separate process under
the limits below; a kernel bug, or anything the host grants to every user (world-readable
files), is not stopped. Run the rollout service in a container/VM without secrets either
way (RELIABILITY.md row B3 asks for nsjail/cgroups/seccomp; this module is the in-process
layer). docs/tools.md has the full matrix of what holds where.

Each call:
- writes the code to ``main.py`` in a fresh temporary directory (the cwd), deleted after;
- runs ``python -I -S -B main.py`` (isolated mode, no site-packages: stdlib only) through
  :mod:`tools._sandbox_launcher`, with an **empty environment** (the interpreter itself
  adds only ``LC_CTYPE=C.UTF-8``, PEP 538) and stdin at /dev/null;
- limits each process: CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later),
  address space (RLIMIT_AS), file size (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no
  core dumps; and the run's process+thread count (RLIMIT_NPROC, see below);
- isolates the network in a new network namespace whose only interface (``lo``) is down:
  directly as root with CAP_SYS_ADMIN, else inside a new user namespace; when neither is
  possible it falls back to an audit-hook guard in the interpreter (weak; logged once);
- with the network namespace, also a **pid namespace**: the program runs as pid 2 under a
  minimal init, so everything it started dies when it exits, and it cannot signal
  processes outside (they have no pid there);
- enforces the wall-clock limit from the parent, then kills the process group and, with
  a per-run uid, every process of that uid (:mod:`tools.sandbox_process`).

As root (``drop_privileges`` defaults to "when root") each run gets **its own uid and
gid** (``uid_base + launcher pid``, unique among live processes), no supplementary
groups, and ``no_new_privs``: it cannot signal, ptrace or read the files of the service
or of other runs, and RLIMIT_NPROC counts exactly this run (root itself ignores
RLIMIT_NPROC). As a normal user the run keeps the service's uid; RLIMIT_NPROC still
counts only this run inside a user namespace on Linux >= 5.14, else it is set to the
user's current task count plus ``max_processes`` (shared, approximate).
``result.metadata["isolation"]`` reports what was in effect for every call.

Not covered: reading world-readable files (``/etc``, the repository; ``/proc`` is not
remounted, so other processes' command lines are visible), writing to world-writable
directories (``/tmp``, ``/dev/shm``: bounded per file by RLIMIT_FSIZE only), the total
memory of a run's processes (each has its own RLIMIT_AS: up to ``max_processes ×
memory_mb``), CPU contention with the service, the kernel's attack surface (no seccomp),
third-party packages. In the audit-hook fallback as a normal user (no root, no user
namespaces) the program shares the service's uid and pid namespace: it can read the
service's ``/proc/<pid>/environ`` and kill it (``os.kill(-1, 9)``); use
``network_isolation="namespace"`` to refuse to run there instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.base import Tool, ToolResult
from tools.sandbox_process import RunOutcome, RunSpec, count_tasks_of_uid, run_isolated
from tools.sandbox_results import outcome_to_result

logger = logging.getLogger(__name__)

MIB = 2**20


class PythonSandboxConfig(BaseModel):
    """Limits and isolation of the ``python`` tool; defaults suit short agent computations."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    wall_timeout_s: float = Field(10.0, gt=0, le=600)
    """Longest wall-clock time of one run; a call's own timeout_s can only shorten it."""
    cpu_time_s: int = Field(10, ge=1, le=600)
    """RLIMIT_CPU per process: SIGXCPU at this many CPU seconds, SIGKILL one second later."""
    memory_mb: int = Field(512, ge=64, le=65536)
    """RLIMIT_AS per process (virtual memory, MiB); Python needs ~30 MiB to start."""
    max_processes: int = Field(16, ge=1, le=4096)
    """RLIMIT_NPROC: processes+threads of the run (see the module docstring for what counts)."""
    max_file_size_mb: int = Field(16, ge=0, le=65536)
    """RLIMIT_FSIZE: largest file the run may write (MiB); writes beyond fail with EFBIG."""
    max_open_files: int = Field(64, ge=16, le=65536)
    """RLIMIT_NOFILE: open file descriptors per process."""
    max_output_bytes: int = Field(16_384, ge=256, le=16 * MIB)
    """Bytes kept of stdout and of stderr each (first and last halves); the rest is counted."""
    max_code_chars: int = Field(100_000, ge=1, le=10_000_000)
    """Longest program accepted."""
    max_concurrent_runs: int = Field(8, ge=1, le=4096)
    """Runs of this tool instance at once; further calls wait (within their timeout)."""
    network_isolation: Literal["auto", "namespace", "audit_hook"] = "auto"
    """auto: network namespace, else audit-hook guard; namespace: refuse to run without one;
    audit_hook: only the (weak) in-interpreter guard."""
    pid_namespace: bool = True
    """Run the program under its own init in a new pid namespace (made together with the
    network namespace): everything it starts dies with it, and it cannot see or signal
    outside processes. False: exec the program directly (two processes fewer per run)."""
    drop_privileges: bool | None = None
    """Run as a per-run uid (needs root). None: when the service runs as root."""
    uid_base: int = Field(2_000_000_000, ge=100_000, le=2**31 - 2**23)
    """Per-run uid = uid_base + launcher pid; choose a range no real user or container uses."""
    interpreter: str | None = None
    """Python for the sandboxed code; None: this interpreter if the run's uid can use it,
    else /usr/bin/python3 or /usr/local/bin/python3."""
    work_root: str | None = None
    """Parent directory of the per-run temporary directories; None: the system default."""


def _usable_by_others(path: str) -> bool:
    """Whether an unprivileged uid can execute ``path`` and read its ``<prefix>/lib``."""
    real = Path(os.path.realpath(path))
    try:
        if not (real.is_file() and real.stat().st_mode & stat.S_IXOTH):
            return False
        lib = real.parent.parent / "lib"
        for directory in [*real.parents, lib]:
            mode = directory.stat().st_mode
            if not mode & stat.S_IXOTH or (directory == lib and not mode & stat.S_IROTH):
                return False
    except OSError:
        return False
    return True


def choose_interpreter(configured: str | None, for_other_uid: bool) -> str:
    """The interpreter for sandboxed code (see ``PythonSandboxConfig.interpreter``)."""
    if configured is not None:
        return configured
    if not for_other_uid:
        return sys.executable
    candidates = [
        sys.executable,
        getattr(sys, "_base_executable", sys.executable),
        "/usr/bin/python3",
        "/usr/local/bin/python3",
    ]
    for candidate in candidates:
        if _usable_by_others(candidate):
            return os.path.realpath(candidate)
    raise RuntimeError(
        "no Python interpreter is usable by an unprivileged uid; set `interpreter` or "
        "`drop_privileges=False`"
    )


class PythonSandbox(Tool):
    """The ``python`` tool (see the module docstring). Safe to call concurrently."""

    name = "python"
    description = (
        "Run a Python 3 program (standard library only, no network, no input) and return "
        "what it prints. Use print() to see results. Files written are discarded."
    )

    def __init__(self, config: PythonSandboxConfig | None = None, **overrides: Any) -> None:
        base = config.model_dump() if config is not None else {}
        self.config = PythonSandboxConfig(**{**base, **overrides})
        is_root = os.geteuid() == 0
        drop = is_root if self.config.drop_privileges is None else self.config.drop_privileges
        if drop and not is_root:
            raise ValueError("drop_privileges=True needs the service to run as root")
        self._drop_privileges = drop
        self.interpreter = choose_interpreter(self.config.interpreter, for_other_uid=drop)
        self._slots = asyncio.Semaphore(self.config.max_concurrent_runs)
        self._warned_weak_isolation = False
        self.parameters = {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": "The program.",
                    "maxLength": self.config.max_code_chars,
                }
            },
            "required": ["code"],
            "additionalProperties": False,
        }

    def _rlimits(self) -> dict[str, tuple[int, int]]:
        """All limits but RLIMIT_NPROC, which the launcher sets once it knows what counts."""
        c = self.config
        return {
            "RLIMIT_CPU": (c.cpu_time_s, c.cpu_time_s + 1),
            "RLIMIT_AS": (c.memory_mb * MIB, c.memory_mb * MIB),
            "RLIMIT_FSIZE": (c.max_file_size_mb * MIB, c.max_file_size_mb * MIB),
            "RLIMIT_NOFILE": (c.max_open_files, c.max_open_files),
            "RLIMIT_CORE": (0, 0),
        }

    async def call(self, arguments: dict[str, Any], *, timeout_s: float) -> ToolResult:
        """Run ``arguments["code"]``; total time (queueing included) stays within timeout_s."""
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult.error("Error: 'code' must be a string.")
        if len(code) > self.config.max_code_chars:
            limit = self.config.max_code_chars
            return ToolResult.error(f"Error: program too long (limit {limit} characters).")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(timeout_s, self.config.wall_timeout_s)
        try:
            async with asyncio.timeout_at(deadline):
                await self._slots.acquire()
        except TimeoutError:
            return ToolResult.error(
                "Error: the python sandbox is busy; try again later.", failure="busy"
            )
        try:
            outcome = await self._run(code, wall_timeout_s=max(deadline - loop.time(), 0.05))
        finally:
            self._slots.release()
        if outcome.report.get("network") == "audit_hook" and not self._warned_weak_isolation:
            self._warned_weak_isolation = True
            logger.warning(
                "python sandbox: no network namespace (%s); using the audit-hook guard only",
                outcome.report.get("network_namespace_error") or "not requested",
            )
        return outcome_to_result(outcome, self.config, self.interpreter)

    async def _run(self, code: str, wall_timeout_s: float) -> RunOutcome:
        workdir = await asyncio.to_thread(
            tempfile.mkdtemp, prefix="asyncrl-python-", dir=self.config.work_root
        )
        try:
            main_py = Path(workdir, "main.py")
            main_py.write_text(code, encoding="utf-8", errors="surrogatepass")
            main_py.chmod(0o444)
            # Without a per-run uid the kernel may count the service's own tasks too.
            uid_tasks = None
            if not self._drop_privileges:
                uid_tasks = await asyncio.to_thread(count_tasks_of_uid, os.getuid())
            spec = RunSpec(
                workdir=workdir,
                interpreter=self.interpreter,
                wall_timeout_s=wall_timeout_s,
                rlimits=self._rlimits(),
                network=self.config.network_isolation,
                pid_namespace=self.config.pid_namespace,
                max_processes=self.config.max_processes,
                uid_tasks=uid_tasks,
                uid_base=self.config.uid_base if self._drop_privileges else None,
                max_output_bytes=self.config.max_output_bytes,
            )
            return await run_isolated(spec)
        finally:
            await asyncio.to_thread(_remove_tree, workdir)


def _remove_tree(path: str) -> None:
    """Delete a run's directory, also where the run took permissions off its own folders."""
    try:
        shutil.rmtree(path)  # does not follow symlinks the run planted
        return
    except FileNotFoundError:
        return
    except OSError:
        pass  # e.g. chmod 0 on a subdirectory: only a problem without root
    try:
        _restore_permissions(path)
        shutil.rmtree(path)
    except OSError:
        logger.exception("could not delete sandbox directory %s", path)


def _restore_permissions(top: str) -> None:
    """chmod 700 every directory below ``top`` (symlinks are not followed, only real
    directories are entered; the run's processes are dead by now)."""
    pending = [top]
    while pending:
        directory = pending.pop()
        os.chmod(directory, stat.S_IRWXU)
        with os.scandir(directory) as entries:
            pending.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
