"""Turning a finished sandbox run into the text the model sees and the metadata we log.

Success (exit status 0): ``content`` is stdout, followed by ``[stderr]`` and stderr when
the program wrote any (warnings), or ``(no output)`` when it printed nothing.

Failure: ``content`` starts with ``Error: <reason>.``, then ``[stdout]`` and ``[stderr]``
sections. The reason is the most specific one the evidence supports:

=================================  ==========================================================
timed out (parent's wall clock)    ``timed out after 2.0 s (wall-clock limit)``
SIGXCPU, or SIGKILL from the CPU    ``CPU time limit exceeded (N s)``
  hard limit
MemoryError / ENOMEM in stderr     ``memory limit exceeded (N MiB)``
EFBIG in stderr, SIGXFSZ           ``file size limit exceeded (N MiB)``
other signal                       ``killed by signal SIGSEGV``
launcher could not isolate         ``sandbox setup failed: ...`` (``failure="setup"``)
other non-zero exit                ``exited with status N`` (the traceback is in [stderr])
=================================  ==========================================================

``metadata`` always has ``exit_code``, ``signal``, ``timed_out``, ``wall_s``,
``stdout_bytes``/``stderr_bytes`` (before truncation), ``truncated``, ``failure`` (None on
success) and ``isolation`` (network mode, uid, rlimits as applied, interpreter, processes
killed after the run).

Not covered: telling a memory-limit SIGKILL from the kernel OOM killer or an external kill
(all three read "killed by signal SIGKILL"), and limits hit inside a child process whose
error message the program swallowed.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from tools._sandbox_launcher import SETUP_FAILED_EXIT_CODE
from tools.base import ToolResult
from tools.sandbox_process import RunOutcome

if TYPE_CHECKING:
    from tools.sandbox_config import PythonSandboxConfig

_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory")
_FILE_SIZE_MARKERS = ("File too large",)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _failure(outcome: RunOutcome, config: PythonSandboxConfig) -> tuple[str, str] | None:
    """(failure kind, reason for the model), or None when the run succeeded."""
    code = outcome.returncode
    if outcome.report.get("setup_error"):
        return "setup", f"sandbox setup failed: {outcome.report['setup_error']}"
    if outcome.timed_out:
        return "timeout", f"timed out after {outcome.wall_limit_s:.1f} s (wall-clock limit)"
    if code is None:
        return "lost", "the program's exit status could not be determined"
    if code == 0:
        return None
    if code == SETUP_FAILED_EXIT_CODE and not outcome.report:
        return "setup", "sandbox setup failed before isolation was reported"
    if code == -signal.SIGXCPU or (code == -signal.SIGKILL and outcome.wall_s >= config.cpu_time_s):
        return "cpu_limit", f"CPU time limit exceeded ({config.cpu_time_s} s)"
    if any(marker in outcome.stderr for marker in _MEMORY_MARKERS):
        return "memory_limit", f"memory limit exceeded ({config.memory_mb} MiB)"
    if code == -signal.SIGXFSZ or any(m in outcome.stderr for m in _FILE_SIZE_MARKERS):
        return "file_size_limit", f"file size limit exceeded ({config.max_file_size_mb} MiB)"
    if code < 0:
        return "signal", f"killed by signal {_signal_name(-code)}"
    return "exit_status", f"exited with status {code}"


def _section(title: str, text: str) -> str:
    return f"\n[{title}]\n{text}" if text else ""


def outcome_to_result(
    outcome: RunOutcome, config: PythonSandboxConfig, interpreter: str
) -> ToolResult:
    """The :class:`ToolResult` for ``outcome`` (see the module docstring)."""
    code = outcome.returncode
    metadata: dict[str, Any] = {
        "exit_code": code,
        "signal": _signal_name(-code) if code is not None and code < 0 else None,
        "timed_out": outcome.timed_out,
        "wall_s": round(outcome.wall_s, 3),
        "stdout_bytes": outcome.stdout_bytes,
        "stderr_bytes": outcome.stderr_bytes,
        "truncated": max(outcome.stdout_bytes, outcome.stderr_bytes) > config.max_output_bytes,
        "isolation": {
            "network": outcome.report.get("network"),
            "network_namespace": outcome.report.get("network_namespace"),
            "pid_namespace": outcome.report.get("pid_namespace"),
            "nproc_counts": outcome.report.get("nproc_counts"),
            "network_namespace_error": outcome.report.get("network_namespace_error"),
            "private_mounts": outcome.report.get("private_mounts"),
            "private_mounts_error": outcome.report.get("private_mounts_error"),
            "uid": outcome.report.get("uid"),
            "rlimits": outcome.report.get("rlimits"),
            "interpreter": interpreter,
            "survivors_killed": outcome.survivors_killed,
            "survivors_left": outcome.survivors_left,
        },
    }
    failure = _failure(outcome, config)
    metadata["failure"] = failure[0] if failure else None
    if failure is None:
        content = outcome.stdout + _section("stderr", outcome.stderr)
        return ToolResult.ok(content if content else "(no output)", **metadata)
    content = (
        f"Error: {failure[1]}."
        + _section("stdout", outcome.stdout)
        + _section("stderr", outcome.stderr)
    )
    return ToolResult.error(content, **metadata)
