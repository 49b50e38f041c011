"""Adversarial tests of the python sandbox's resource limits: one property per test.

Each hostile program must come back as an error result, within its limit, with the parent
unaffected; the ``make_sandbox`` fixture additionally fails any test after which a process
of a sandbox uid is still alive or a run directory is left behind.
"""

from __future__ import annotations

import asyncio
import os
import resource
import textwrap
import time
from pathlib import Path

import pytest

from tests.tools.sandbox_helpers import root_only, sandbox_pids
from tools.python_sandbox import PythonSandbox


async def run(sandbox: PythonSandbox, code: str, timeout_s: float = 10.0):
    return await sandbox.call({"code": textwrap.dedent(code)}, timeout_s=timeout_s)


async def test_plain_program_prints_its_output(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "print(6 * 7)")
    assert not result.is_error, result.content
    assert result.content == "42\n"
    assert result.metadata["exit_code"] == 0


async def test_infinite_loop_is_stopped_by_the_cpu_limit(make_sandbox) -> None:
    sandbox = make_sandbox(cpu_time_s=1, wall_timeout_s=30)
    result = await run(sandbox, "while True: pass", timeout_s=30)
    assert result.is_error
    assert result.metadata["failure"] == "cpu_limit"  # not the 30 s wall clock
    assert "CPU time limit exceeded (1 s)" in result.content


async def test_sleeping_program_is_stopped_by_the_wall_clock(make_sandbox) -> None:
    sandbox = make_sandbox(wall_timeout_s=1.0)
    started = time.monotonic()
    result = await run(sandbox, "import time\ntime.sleep(60)")
    assert result.is_error and result.metadata["timed_out"]
    assert "timed out after 1.0 s" in result.content
    assert time.monotonic() - started < 2.5


async def test_call_timeout_shorter_than_the_config_wins(make_sandbox) -> None:
    sandbox = make_sandbox(wall_timeout_s=30.0)
    started = time.monotonic()
    result = await run(sandbox, "import time\ntime.sleep(60)", timeout_s=1.0)
    assert result.metadata["failure"] == "timeout"
    assert time.monotonic() - started < 2.5


async def test_ten_gigabyte_allocation_fails_and_parent_is_unaffected(
    sandbox: PythonSandbox,
) -> None:
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = await run(sandbox, "x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.is_error
    assert result.metadata["failure"] == "memory_limit"
    assert "memory limit exceeded" in result.content and "allocated" not in result.content
    rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss_after_kib - rss_before_kib < 50 * 1024
    assert (await run(sandbox, "print('still fine')")).content == "still fine\n"


async def test_gradual_allocation_hits_the_memory_limit(make_sandbox) -> None:
    sandbox = make_sandbox(memory_mb=128)
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(8 * 2**20))"
    result = await run(sandbox, code)
    assert result.metadata["failure"] == "memory_limit"


@root_only
async def test_fork_bomb_is_capped_and_fully_killed(make_sandbox) -> None:
    sandbox = make_sandbox(max_processes=8, wall_timeout_s=2.0, cpu_time_s=3)
    bomb = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    call = asyncio.create_task(run(sandbox, bomb))
    peak = 0
    while not call.done():  # sample the run's processes while the bomb is live (bounded by the run's own timeout)
        peak = max(peak, len(sandbox_pids()))
        await asyncio.sleep(0.05)
    result = call.result()
    assert result.is_error and result.metadata["failure"] == "timeout"
    # + 2: the launcher and the pid namespace's init, which wait for the program
    assert 1 < peak <= 8 + 2, f"saw {peak} processes of the run at once"
    assert result.metadata["isolation"]["survivors_left"] == 0
    assert sandbox_pids() == {}


@root_only
async def test_process_count_is_capped_at_max_processes(make_sandbox) -> None:
    sandbox = make_sandbox(max_processes=5)
    code = """
        import os, time
        started = 0
        for _ in range(50):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            started += 1
        print(started)
    """
    result = await run(sandbox, code)
    assert not result.is_error, result.content
    assert int(result.content) == 4  # the program itself is the fifth process


@root_only
async def test_thread_count_is_capped_too(make_sandbox) -> None:
    sandbox = make_sandbox(max_processes=5)
    code = """
        import threading, time
        started = 0
        try:
            for _ in range(50):
                threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
                started += 1
        except RuntimeError:
            pass
        print(started)
    """
    result = await run(sandbox, code)
    assert int(result.content) == 4


ESCAPED_SLEEPER_MARKER = "61.2345"  # a sleep duration no other process on the host uses


def escaped_sleepers() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.split(b"\0")[:2] == [b"sleep", ESCAPED_SLEEPER_MARKER.encode()]:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("pid_namespace", [True, False], ids=["pid-namespace", "uid-sweep"])
async def test_child_that_leaves_the_process_group_is_killed_after_the_run(
    make_sandbox, pid_namespace: bool
) -> None:
    """Killed by the namespace's end (pid namespace) or by the sweep of the run's uid."""
    sandbox = make_sandbox(pid_namespace=pid_namespace)
    code = f"""
        import os
        if os.fork() == 0:
            os.setsid()  # leave the process group that the parent kills
            os.execv("/bin/sleep", ["sleep", "{ESCAPED_SLEEPER_MARKER}"])
        import time
        time.sleep(0.3)  # not a wait for a state: room for the child to reach exec (if not, the check is only weaker)
        print("parent exits")
    """
    result = await run(sandbox, code)
    assert not result.is_error, result.content
    assert result.metadata["isolation"]["pid_namespace"] is pid_namespace
    assert escaped_sleepers() == []
    if not pid_namespace:
        assert result.metadata["isolation"]["survivors_killed"] == 1


async def test_large_file_write_hits_the_file_size_limit(make_sandbox) -> None:
    sandbox = make_sandbox(max_file_size_mb=1)
    code = "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (2 * 2**20))"
    result = await run(sandbox, code)
    assert result.metadata["failure"] == "file_size_limit"


async def test_long_output_is_truncated_keeping_head_and_tail(make_sandbox) -> None:
    sandbox = make_sandbox(max_output_bytes=1000)
    result = await run(sandbox, "print('a' * 1000 + 'b' * 100_000 + 'z' * 1000)")
    assert not result.is_error
    assert result.content.startswith("a" * 500) and result.content.rstrip().endswith("z" * 499)
    assert "bytes omitted" in result.content and len(result.content) < 1100
    assert result.metadata["stdout_bytes"] == 102_001 and result.metadata["truncated"]


async def test_endless_output_costs_the_parent_bounded_memory(make_sandbox) -> None:
    sandbox = make_sandbox(wall_timeout_s=1.5, max_output_bytes=1000)
    code = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)"
    result = await run(sandbox, code)
    assert result.metadata["failure"] in ("timeout", "cpu_limit")
    assert result.metadata["stdout_bytes"] > 10 * 2**20  # it really did flood the pipe
    assert len(result.content) < 1200


async def test_a_service_with_umask_077_still_runs_programs(make_sandbox) -> None:
    """Issue 48 item 5: the run-writing commands start with umask 077. In root mode the run's
    directory is bound back under a fresh /tmp: the path down to it was then created 0700 and
    the run's uid could not open main.py (every program failed with Permission denied)."""
    before = os.umask(0o077)
    try:
        result = await run(make_sandbox(), "print(6 * 7)")
    finally:
        os.umask(before)
    assert not result.is_error and result.content == "42\n", result.content
