"""The ``python`` tool: run model-written code in a resource-limited, isolated subprocess.

**It fails closed** (issue 30). Model code runs only with real isolation, else the tool
refuses to be built (a clear error at the service's start naming the settings):

- as **its own uid** (``uid_base + launcher pid``), never the service's: the service must run
  as root (in a container: ``cap_add`` SETUID, SETGID, CHOWN, KILL, DAC_OVERRIDE and FOWNER
  after ``cap_drop: ALL``). A run cannot read the service's ``/proc/<pid>/environ`` (its
  tokens), its files (the outbox), nor signal it;
- with **no network**: a new network namespace whose only interface, ``lo``, is down
  (root with CAP_SYS_ADMIN, or a user namespace as the per-run uid), or, where neither can be
  made, a process that already has no network (only ``lo`` in ``/proc/net/dev``: a container
  with ``network_mode: none``), reported as ``no_network``. There is no weaker fallback: the
  audit-hook guard of earlier versions was escaped by ``_posixsubprocess.fork_exec``.

Where the service itself cannot give that (the compose services run as uid 10001 with
``cap_drop: ALL``), set ``sandbox_url`` (``rollout.python_sandbox_url``): the runs then happen
in a **python sandbox server** (``asyncrl python-sandbox``, :mod:`tools.sandbox_server`),
in a container of its own with no network, no secrets, a read-only root and process, memory
and CPU limits, reached over a unix socket only the service's uid may open
(:mod:`tools.sandbox_client`). docs/security.md has the threat model.

Each local call:
- writes the code to ``main.py`` in a fresh temporary directory (the cwd), deleted after;
- runs ``python -I -S -B main.py`` (isolated mode, no site-packages: stdlib only) through
  :mod:`tools._sandbox_launcher`, with an **empty environment** (the interpreter itself
  adds only ``LC_CTYPE=C.UTF-8``, PEP 538) and stdin at /dev/null;
- limits each process: CPU time (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later),
  address space (RLIMIT_AS), file size (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no
  core dumps; and the run's process+thread count (RLIMIT_NPROC: counts exactly this run,
  whose uid is its own);
- with the network namespace, also a **pid namespace** where it can be made: the program
  runs as pid 2 under a minimal init, so everything it started dies when it exits, and it
  cannot signal processes outside (they have no pid there);
- enforces the wall-clock limit from the parent, then kills the process group and every
  process of the run's uid (:mod:`tools.sandbox_process`); ``no_new_privs`` throughout.
``result.metadata["isolation"]`` reports what was in effect for every call.

Not covered: reading world-readable files (``/etc``, the repository; ``/proc`` is not
remounted, so other processes' command lines are visible), writing to world-writable
directories (``/tmp``, ``/dev/shm``: bounded per file by RLIMIT_FSIZE only), the total
memory of a run's processes (each has its own RLIMIT_AS: up to ``max_processes ×
memory_mb``), CPU contention with the service, the kernel's attack surface (no seccomp),
third-party packages. In ``no_network`` mode without a pid namespace, runs see each other's
processes (different uids: they cannot signal or trace them) and may talk over loopback.
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
from typing import Any

from tools.base import Tool, ToolResult
from tools.sandbox_client import RemoteSandbox
from tools.sandbox_config import MIB, PythonSandboxConfig
from tools.sandbox_process import RunOutcome, RunSpec, probe_isolation, run_isolated
from tools.sandbox_results import outcome_to_result

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0  # the start-up check's trivial run (a busy machine starts an interpreter slowly)


class SandboxUnavailable(RuntimeError):
    """The python tool cannot isolate model code here: the service must not start with it."""


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
        self._slots = asyncio.Semaphore(self.config.max_concurrent_runs)
        self.remote = RemoteSandbox(self.config.sandbox_url) if self.config.sandbox_url else None
        self.interpreter: str | None = None
        self.isolation: dict[str, Any] = {"remote": self.config.sandbox_url} if self.remote else {}
        if self.remote is None:
            self.interpreter = choose_interpreter(self.config.interpreter, for_other_uid=True)
            self.isolation = self._require_isolation()
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

    def _require_isolation(self) -> dict[str, Any]:
        """Run one trivial program now; raise :class:`SandboxUnavailable` unless it ran as its
        own uid with no network (module docstring). Returns the launcher's report."""
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "the python tool runs model code as a per-run uid, which needs the rollout service to run as root "
                "(in a container: cap_add SETUID, SETGID, CHOWN, KILL, DAC_OVERRIDE, FOWNER); or set "
                "rollout.python_sandbox_url to a python sandbox server (asyncrl python-sandbox; compose: the "
                "python-sandbox service). Refusing to run model code as the service's own uid.")
        workdir = tempfile.mkdtemp(prefix="asyncrl-python-probe-", dir=self.config.work_root)
        try:
            Path(workdir, "main.py").write_text("pass\n")
            report = probe_isolation(self._spec(workdir, wall_timeout_s=PROBE_TIMEOUT_S))
        finally:
            _remove_tree(workdir)
        if report.get("setup_error") or report.get("network") not in ("namespace", "no_network") or not report.get("uid"):
            raise SandboxUnavailable(
                f"the python tool cannot isolate model code here: {report.get('setup_error') or report}. It needs a "
                "network namespace (CAP_SYS_ADMIN, or user namespaces) or a process without network (a container with "
                "network_mode: none); or set rollout.python_sandbox_url to a python sandbox server.")
        return report

    def _spec(self, workdir: str, wall_timeout_s: float) -> RunSpec:
        return RunSpec(
            workdir=workdir,
            interpreter=self.interpreter,
            wall_timeout_s=wall_timeout_s,
            rlimits=self._rlimits(),
            network=self.config.network_isolation,
            pid_namespace=self.config.pid_namespace,
            max_processes=self.config.max_processes,
            uid_tasks=None,
            uid_base=self.config.uid_base,
            max_output_bytes=self.config.max_output_bytes,
            hidden=tuple(self.config.hidden_paths),
        )

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
            wall_s = max(deadline - loop.time(), 0.05)
            if self.remote is not None:
                return await self.remote.run(code, wall_s)
            outcome = await self._run(code, wall_timeout_s=wall_s)
        finally:
            self._slots.release()
        return outcome_to_result(outcome, self.config, self.interpreter)

    async def _run(self, code: str, wall_timeout_s: float) -> RunOutcome:
        workdir = await asyncio.to_thread(
            tempfile.mkdtemp, prefix="asyncrl-python-", dir=self.config.work_root
        )
        try:
            main_py = Path(workdir, "main.py")
            main_py.write_text(code, encoding="utf-8", errors="surrogatepass")
            main_py.chmod(0o444)
            return await run_isolated(self._spec(workdir, wall_timeout_s))
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
