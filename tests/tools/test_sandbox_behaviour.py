"""The python sandbox as a tool: result texts, concurrency, and a non-blocking event loop."""

from __future__ import annotations

import asyncio
import textwrap
import time

from tests.helpers.waiting import WAIT_S, wait_for
from tools.python_sandbox import PythonSandbox, PythonSandboxConfig
from tools.registry import ToolRegistry


async def run(sandbox: PythonSandbox, code: str, timeout_s: float = 10.0):
    return await sandbox.call({"code": textwrap.dedent(code)}, timeout_s=timeout_s)


async def test_exception_is_an_error_result_with_the_traceback(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "print('partial')\nraise ValueError('boom')")
    assert result.is_error and result.metadata["failure"] == "exit_status"
    assert result.content.startswith("Error: exited with status 1.")
    assert "[stdout]\npartial" in result.content and "ValueError: boom" in result.content


async def test_syntax_error_is_an_error_result(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "def f(:\n    pass")
    assert result.is_error and "SyntaxError" in result.content


async def test_sys_exit_zero_is_success_and_silence_says_so(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "import sys\nsys.exit(0)")
    assert not result.is_error and result.content == "(no output)"


async def test_stderr_of_a_successful_run_is_shown_after_stdout(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "import sys\nprint('out')\nprint('warn', file=sys.stderr)")
    assert not result.is_error and result.content == "out\n\n[stderr]\nwarn\n"


async def test_program_killed_by_a_signal_is_named(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert result.is_error and "killed by signal SIGSEGV" in result.content


async def test_non_utf8_output_does_not_break_the_result(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')")
    assert (
        not result.is_error and result.content.startswith("ok ") and result.content.endswith(" end")
    )


async def test_oversized_program_is_refused_without_running(make_sandbox) -> None:
    result = await run(make_sandbox(max_code_chars=100), "print(1)  #" + "x" * 200)
    assert result.is_error and "too long" in result.content


async def test_concurrent_calls_run_in_parallel(sandbox: PythonSandbox) -> None:
    started = time.monotonic()
    results = await asyncio.gather(
        *(run(sandbox, "import time\ntime.sleep(1)\nprint('done')") for _ in range(6))
    )
    elapsed = time.monotonic() - started
    assert [r.content for r in results] == ["done\n"] * 6
    assert elapsed < 3.5, f"6 one-second sleeps took {elapsed:.1f} s"  # serial: >= 6 s


async def test_max_concurrent_runs_queues_the_rest(make_sandbox) -> None:
    sandbox = make_sandbox(max_concurrent_runs=1)
    started = time.monotonic()
    results = await asyncio.gather(
        *(run(sandbox, "import time\ntime.sleep(0.4)") for _ in range(3))
    )
    assert not any(r.is_error for r in results)
    assert time.monotonic() - started >= 1.2


async def test_queued_call_gives_up_within_its_timeout(make_sandbox, work_root) -> None:
    sandbox = make_sandbox(max_concurrent_runs=1)
    holder = asyncio.create_task(run(sandbox, "import time\ntime.sleep(2)"))
    # a run's directory exists only while it holds a slot
    await wait_for(lambda: any(work_root.iterdir()), WAIT_S, "the first run to hold the only slot")
    started = time.monotonic()
    result = await run(sandbox, "print(1)", timeout_s=0.5)
    assert result.is_error and result.metadata["failure"] == "busy"
    assert time.monotonic() - started < 1.0
    await holder


async def test_event_loop_stays_responsive_during_runs(sandbox: PythonSandbox) -> None:
    """Runs wait off the event loop: while four programs each sleep a second, another coroutine
    keeps getting turns. A loop blocked by a run would give it none until the runs returned
    (counted, not timed: a loaded machine slows the turns, it does not stop them)."""
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    before = ticks
    results = await asyncio.gather(*(run(sandbox, "import time; time.sleep(1.0); print('done')") for _ in range(4)))
    during = ticks - before
    beat.cancel()
    assert all(r.content.strip().endswith("done") for r in results), results
    assert during >= 3, f"the event loop got {during} turns while the runs went on"


async def test_registry_runs_python_from_json_arguments(make_sandbox) -> None:
    registry = ToolRegistry([make_sandbox()])
    result = await registry.execute("python", '{"code": "print(2 ** 10)"}', timeout_s=5)
    assert result.content == "1024\n"


def test_config_rejects_out_of_range_limits() -> None:
    for bad in ({"memory_mb": 1}, {"wall_timeout_s": 0}, {"max_processes": 0}, {"unknown": 1}):
        try:
            PythonSandboxConfig(**bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_tool_schema_is_an_openai_function(sandbox: PythonSandbox) -> None:
    schema = sandbox.schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "python"
    assert schema["function"]["parameters"]["required"] == ["code"]
