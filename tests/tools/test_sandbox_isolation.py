"""Adversarial tests of the python sandbox's isolation: network, environment, files, uid.

One property per test. Network tests start a real listener in the test and check both
sides: the program's connect fails *and* the listener never saw a connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.waiting import WAIT_S, wait_for
from tests.tools.sandbox_helpers import TEST_UID_BASE, root_only, sandbox_pids
from tools.python_sandbox import PythonSandbox, SandboxUnavailable

CONNECT_PROGRAM = """
    import socket, sys
    try:
        socket.create_connection((sys.argv_host, sys.argv_port), timeout=2).close()
        print("connected")
    except OSError as exc:
        print("blocked:", type(exc).__name__, exc)
"""


def connect_program(host: str, port: int) -> str:
    code = textwrap.dedent(CONNECT_PROGRAM)
    return code.replace("sys.argv_host", repr(host)).replace("sys.argv_port", str(port))


async def run(sandbox: PythonSandbox, code: str, timeout_s: float = 10.0):
    return await sandbox.call({"code": textwrap.dedent(code)}, timeout_s=timeout_s)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A real TCP listener on 127.0.0.1 (non-blocking, so accept() shows who connected)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    try:
        yield server
    finally:
        server.close()


def accepted_connection(server: socket.socket) -> bool:
    try:
        connection, _ = server.accept()
    except BlockingIOError:
        return False
    connection.close()
    return True


async def test_loopback_listener_is_unreachable(sandbox: PythonSandbox, listener) -> None:
    result = await run(sandbox, connect_program("127.0.0.1", listener.getsockname()[1]))
    assert result.content.startswith("blocked:"), result.content
    assert not accepted_connection(listener)


async def test_metadata_and_cloud_ips_are_unreachable(sandbox: PythonSandbox) -> None:
    for host, port in [("169.254.169.254", 80), ("1.1.1.1", 53)]:
        result = await run(sandbox, connect_program(host, port))
        assert result.content.startswith("blocked:"), (host, result.content)


async def test_public_dns_name_does_not_resolve(sandbox: PythonSandbox) -> None:
    code = "import socket\ntry:\n    print(socket.getaddrinfo('example.com', 80))\nexcept OSError as e:\n    print('blocked', e)"
    result = await run(sandbox, code)
    assert result.content.startswith("blocked"), result.content


@root_only
async def test_namespace_isolation_is_reported_when_required(make_sandbox) -> None:
    result = await run(make_sandbox(network_isolation="namespace"), "print('ok')")
    assert result.content == "ok\n"
    assert result.metadata["isolation"]["network"] == "namespace"


def test_the_audit_hook_mode_and_the_service_uid_are_refused_with_the_reason() -> None:
    """Issue 30: the audit-hook fallback was escaped by ``_posixsubprocess.fork_exec``; it is
    gone, and so is running model code as the service's uid."""
    with pytest.raises(ValueError, match="audit_hook' was removed"):
        PythonSandbox(network_isolation="audit_hook")
    with pytest.raises(ValueError, match="service's own uid"):
        PythonSandbox(drop_privileges=False)


def test_without_root_the_tool_refuses_to_start_and_names_the_settings(monkeypatch, work_root) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match="rollout.python_sandbox_url") as refused:
        PythonSandbox(work_root=str(work_root))
    assert "root" in str(refused.value) and "service's own uid" in str(refused.value)


@root_only
async def test_the_start_up_probe_reports_the_isolation_every_run_gets(sandbox: PythonSandbox) -> None:
    assert sandbox.isolation["network"] == "namespace" and sandbox.isolation["uid"] >= TEST_UID_BASE
    result = await run(sandbox, "print('ok')")
    assert result.metadata["isolation"]["network"] == sandbox.isolation["network"]


async def test_environment_is_empty(sandbox: PythonSandbox, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCRL_TEST_SECRET", "hunter2-secret-value")
    result = await run(sandbox, "import json, os\nprint(json.dumps(dict(os.environ)))")
    environment = json.loads(result.content)
    assert set(environment) <= {"LC_CTYPE"}, environment  # PEP 538: set by the interpreter
    assert "hunter2" not in result.content and "PATH" not in environment


async def test_service_environment_is_unreadable_through_proc(sandbox) -> None:
    """/proc/<service pid>/environ holds the service's startup environment (its secrets)."""
    code = f"""
        try:
            print(open('/proc/{os.getpid()}/environ', 'rb').read())
        except OSError as exc:
            print('denied', type(exc).__name__)
    """
    result = await run(sandbox, code)
    # root mode: the run's procfs (hidepid=2) has no entry for the service at all
    assert result.content in ("denied PermissionError\n", "denied FileNotFoundError\n"), result.content


async def test_stdin_is_empty(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "import sys\nprint(repr(sys.stdin.read()))")
    assert result.content == "''\n"


async def test_working_directory_is_fresh_and_deleted(sandbox: PythonSandbox) -> None:
    code = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    result = await run(sandbox, code)
    cwd, listing = result.content.splitlines()
    assert listing == "['main.py', 'scratch.txt']"
    assert not Path(cwd).exists()


async def test_directory_the_program_locked_is_still_deleted(sandbox, work_root) -> None:
    code = "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d/e', 0)\nos.chmod('d', 0)"
    result = await run(sandbox, code)
    assert not result.is_error, result.content
    assert list(work_root.iterdir()) == []


async def test_cleanup_does_not_follow_symlinks_out_of_the_directory(sandbox) -> None:
    outside = Path(tempfile.mkdtemp(prefix="asyncrl-test-canary-"))
    try:
        (outside / "canary").write_text("alive")
        outside.chmod(0o755)
        code = f"import os\nos.symlink({str(outside)!r}, 'link')\nos.symlink({str(outside / 'canary')!r}, 'file')"
        result = await run(sandbox, code)
        assert not result.is_error, result.content
        assert (outside / "canary").read_text() == "alive"
    finally:
        shutil.rmtree(outside)


async def test_working_directory_is_deleted_after_a_timeout(make_sandbox, work_root) -> None:
    result = await run(make_sandbox(wall_timeout_s=0.5), "import time\ntime.sleep(30)")
    assert result.metadata["timed_out"]
    assert list(work_root.iterdir()) == []


async def test_cancelled_call_kills_the_run_and_deletes_its_directory(
    make_sandbox, work_root
) -> None:
    call = asyncio.create_task(run(make_sandbox(), "import time\ntime.sleep(30)"))
    # the run's process is visible by its uid once it started
    await wait_for(lambda: any(work_root.glob("*/main.py")) and sandbox_pids(), WAIT_S, "the run to start")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(call, 5)
    assert list(work_root.iterdir()) == []
    assert sandbox_pids() == {}


@root_only
async def test_program_runs_as_an_unprivileged_per_run_uid(sandbox: PythonSandbox) -> None:
    result = await run(sandbox, "import os\nprint(os.getuid(), os.getgid(), os.getgroups())")
    uid, gid, groups = result.content.split(maxsplit=2)
    assert int(uid) == result.metadata["isolation"]["uid"] and int(uid) >= 1_000_000
    assert gid == uid and groups.strip() == "[]"


async def test_program_cannot_signal_the_service(sandbox: PythonSandbox) -> None:
    """Denied by uid (as root) or invisible from the pid namespace (ProcessLookupError)."""
    code = f"""
        import os
        try:
            os.kill({os.getpid()}, 0)
            print('reachable')
        except (PermissionError, ProcessLookupError):
            print('denied')
    """
    result = await run(sandbox, code)
    assert result.content == "denied\n"


@root_only
async def test_program_cannot_write_outside_its_directory(sandbox: PythonSandbox) -> None:
    # a host directory the run's mount namespace keeps (/tmp and /var/tmp are its own tmpfs there)
    target = Path(tempfile.mkdtemp(prefix="asyncrl-test-readonly-", dir="/var/lib"))
    try:
        target.chmod(0o755)
        code = f"try:\n    open({str(target / 'pwned')!r}, 'w')\n    print('wrote')\nexcept PermissionError:\n    print('denied')"
        assert (await run(sandbox, code)).content == "denied\n"
        assert not (target / "pwned").exists()
    finally:
        os.rmdir(target)


@root_only
async def test_program_cannot_read_root_only_files(sandbox: PythonSandbox) -> None:
    if not Path("/etc/shadow").exists():
        pytest.skip("no /etc/shadow here")
    code = "try:\n    open('/etc/shadow').read()\n    print('read')\nexcept PermissionError:\n    print('denied')"
    assert (await run(sandbox, code)).content == "denied\n"


@root_only
async def test_concurrent_runs_cannot_read_each_others_directories(make_sandbox, work_root) -> None:
    sandbox = make_sandbox()
    writer = asyncio.create_task(
        run(sandbox, "open('secret.txt', 'w').write('s')\nimport time\ntime.sleep(2)")
    )
    await wait_for(lambda: any(work_root.glob("*/secret.txt")), WAIT_S, "the writer's secret file")
    peek = """
        import os
        others = [d for d in os.listdir('..') if os.path.join('..', d) != os.path.join('..', os.path.basename(os.getcwd()))]
        for other in others:
            try:
                print(os.listdir(os.path.join('..', other)))
            except PermissionError:
                print('denied')
        print('looked at', len(others))
    """
    result = await run(sandbox, peek)
    await writer
    # root mode: the run's private /tmp holds its own directory alone (the other is not even
    # there); elsewhere the other's directory is there and closed
    assert result.content in ("denied\nlooked at 1\n", "looked at 0\n"), result.content


async def test_shared_memory_a_program_leaves_dies_with_its_run(make_sandbox) -> None:
    """Issue 67 M3: the sandbox had the host's IPC namespace, so a System V segment a run left
    (64 MiB, outside its memory limit) outlived it and a later run under another uid could read
    it. The program creates a segment under a fixed key and leaves it: the host never sees that
    key, and a second run finds no segment under it."""
    import ctypes

    key = 0x5A17C0DE
    program = f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        shmid = libc.shmget({key}, 1 << 20, 0o1666)  # IPC_CREAT | 0666
        print("created", shmid >= 0)
    """
    probe = f"""
        import ctypes
        print("found", ctypes.CDLL(None).shmget({key}, 0, 0o666) >= 0)
    """
    sandbox = make_sandbox()
    first = await run(sandbox, program)
    assert "created True" in first.content, first.content
    second = await run(sandbox, probe)
    assert "found False" in second.content, second.content
    host_keys = Path("/proc/sysvipc/shm").read_text().split("\n")[1:]
    assert not any(line.split() and int(line.split()[0]) == key for line in host_keys), "the segment outlived the run"
    assert ctypes.CDLL(None).shmget(key, 0, 0o666) < 0
