"""The python tool's escapes stay closed (issue 30 item 2): what the security review's probe did
through the old audit-hook fallback — start a new interpreter with ``_posixsubprocess.fork_exec``
(what ``subprocess`` uses) and reach a loopback listener — and the other ways out: raw
``ctypes`` sockets, the service's environment through ``/proc``, the service's files, a
signal to the service, the sandbox server's own socket.

Each probe runs in the local sandbox (the service is root here: per-run uid, network and pid
namespaces) and through a python sandbox server (``asyncrl python-sandbox`` on a unix socket,
a separate process as in compose), and must fail; the listener must never see a connection.
The Docker test (tests/deploy/test_compose_run.py) runs the same probes in compose's
``python-sandbox`` container, where the isolation is the container's (no network, no
CAP_SYS_ADMIN): docs/security.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asyncrl.launch import log_tail
from tests.helpers.waiting import wait_for_sync
from tests.tools.sandbox_helpers import IS_ROOT, TIGHT_LIMITS, sandbox_pids
from tools._sandbox_launcher import network_interfaces
from tools.python_sandbox import PythonSandbox

pytestmark = pytest.mark.skipif(not IS_ROOT, reason="the python tool runs programs only as a per-run uid, which needs root")

SECRET = "hunter2-service-secret-0123456789"


def probes(listener_port: int, service_pid: int, service_dir: Path | str, server_socket: str,
           host: str = "127.0.0.1") -> dict[str, tuple[str, str]]:
    """name → (program, what its output must contain to show the probe really ran). A
    program prints ``ESCAPED ...`` if it got out. Also sent into compose's sandbox container
    by tests/deploy/test_compose_run.py."""
    connect = ("print('child started', flush=True); import socket; "
               f"socket.create_connection(({host!r}, {listener_port}), timeout=2); print('ESCAPED connected')")
    return {
        "subprocess interpreter to loopback": (f"""
            import subprocess, sys
            done = subprocess.run([sys.executable, '-I', '-c', {connect!r}], capture_output=True, text=True, timeout=8)
            print(done.stdout.strip(), done.stderr.strip()[-120:])
        """, "child started"),
        "fork_exec interpreter to loopback": (f"""
            import _posixsubprocess, os, sys
            r, w = os.pipe()
            er, ew = os.pipe()
            pid = _posixsubprocess.fork_exec(  # CPython 3.11's signature (what subprocess calls)
                [sys.executable, '-I', '-c', {connect!r}], [sys.executable.encode()], True, (ew,), None, None,
                -1, -1, -1, w, -1, -1, er, ew, False, False, -1, None, None, None, -1, None, False)
            os.close(w)
            os.close(ew)
            out = b''
            while chunk := os.read(r, 200):
                out += chunk
            os.waitpid(pid, 0)
            print(out.decode().strip())
        """, "child started"),
        "posix_spawn interpreter to loopback": (f"""
            import os, sys
            pid = os.posix_spawn(sys.executable, [sys.executable, '-I', '-c', {connect!r}], {{}})
            print('exit status', os.waitpid(pid, 0)[1])
        """, "child started"),
        "ctypes raw socket to loopback": (f"""
            import ctypes, socket, struct
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.socket(2, 1, 0)
            addr = struct.pack('=H', 2) + struct.pack('!H', {listener_port}) + socket.inet_aton({host!r}) + bytes(8)
            rc = libc.connect(fd, ctypes.c_char_p(addr), len(addr))
            print('ESCAPED connected' if rc == 0 else f'blocked errno {{ctypes.get_errno()}}')
        """, "blocked errno"),
        "service environment through /proc": (f"""
            try:
                data = open('/proc/{service_pid}/environ', 'rb').read()
                print('ESCAPED read', len(data), 'bytes')
            except OSError as exc:
                print('blocked', type(exc).__name__)
        """, "blocked"),
        "own environment": (f"import os; print('ESCAPED' if '{SECRET}' in str(os.environ) else 'clean', sorted(os.environ))", "clean"),
        "write into the service's directory": (f"""
            try:
                open({str(Path(service_dir) / 'planted.traj')!r}, 'wb').write(b'x')
                print('ESCAPED wrote')
            except OSError as exc:
                print('blocked', type(exc).__name__)
        """, "blocked"),
        "signal the service": (f"""
            import os
            try:
                os.kill({service_pid}, 0)
                print('ESCAPED may signal')
            except OSError as exc:
                print('blocked', type(exc).__name__)
        """, "blocked"),
        "connect to the sandbox server's socket": (f"""
            import socket
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect({server_socket!r})
                print('ESCAPED connected')
            except OSError as exc:
                print('blocked', type(exc).__name__)
        """, "blocked"),
    }


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    try:
        yield server
    finally:
        server.close()


def _accepted(listener: socket.socket) -> bool:
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return False
    return True


@pytest.fixture
def service_dir(tmp_path: Path) -> Path:
    """A directory of the service's, as its outbox is: root's, 0755."""
    d = tmp_path / "outbox"
    d.mkdir()
    d.chmod(0o755)
    return d


@pytest.fixture
def sandbox_server(tmp_path: Path, work_root: Path, monkeypatch) -> Iterator[tuple[str, subprocess.Popen]]:
    """``asyncrl python-sandbox`` on a unix socket, as a separate process."""
    path = str(tmp_path / "sock" / "python.sock")
    limits = {**TIGHT_LIMITS, "work_root": str(work_root), "wall_timeout_s": 10.0}
    log = tmp_path / "sandbox-server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "python-sandbox", "--socket", path, "--limits", json.dumps(limits)],
                                stdout=out, stderr=subprocess.STDOUT, env={"PATH": os.environ.get("PATH", "")})
    try:
        wait_for_sync(lambda: os.path.exists(path) or proc.poll() is not None, 60, "the sandbox server's socket")
        assert proc.poll() is None, log_tail(log)
        yield path, proc
    finally:
        proc.terminate()
        proc.wait(30)


async def _escapes(run, listener: socket.socket, service_dir: Path, server_socket: str) -> dict[str, tuple[str, str]]:
    out = {}
    for name, (code, ran) in probes(listener.getsockname()[1], os.getpid(), service_dir, server_socket).items():
        result = await run(textwrap.dedent(code))
        out[name] = (result.content, ran)
    return out


def _assert_closed(outcomes: dict[str, tuple[str, str]], listener: socket.socket, service_dir: Path) -> None:
    escaped = {name: text for name, (text, _) in outcomes.items() if "ESCAPED" in text}
    assert not escaped, escaped
    did_not_run = {name: text for name, (text, ran) in outcomes.items() if ran not in text}
    assert not did_not_run, f"probes that did not get as far as trying: {did_not_run}"
    assert not _accepted(listener), "the listener saw a connection"
    assert list(service_dir.iterdir()) == []


async def test_the_local_sandbox_closes_every_escape(monkeypatch, listener, service_dir, work_root, tmp_path):
    monkeypatch.setenv("ASYNCRL_SECURITY__API_TOKEN", SECRET)  # the service's environment holds a secret
    sandbox = PythonSandbox(**{**TIGHT_LIMITS, "work_root": str(work_root)})
    server_socket = str(tmp_path / "no-server.sock")
    outcomes = await _escapes(lambda code: sandbox.call({"code": code}, timeout_s=10), listener, service_dir, server_socket)
    _assert_closed(outcomes, listener, service_dir)
    assert sandbox_pids() == {}


async def test_a_sandbox_server_closes_every_escape_and_serves_runs(listener, service_dir, sandbox_server):
    path, proc = sandbox_server
    mode = os.stat(path)
    assert stat.S_IMODE(mode.st_mode) == 0o600 and mode.st_uid == os.getuid()
    client = PythonSandbox(sandbox_url=f"unix://{path}")
    ok = await client.call({"code": "print(6 * 7)"}, timeout_s=10)
    assert ok.content == "42\n" and not ok.is_error, ok
    assert ok.metadata["isolation"]["network"] in ("namespace", "no_network") and ok.metadata["isolation"]["uid"]
    outcomes = await _escapes(lambda code: client.call({"code": code}, timeout_s=10), listener, service_dir, path)
    _assert_closed(outcomes, listener, service_dir)
    transport = httpx.AsyncHTTPTransport(uds=path)
    async with httpx.AsyncClient(transport=transport, timeout=10) as http:
        health = (await http.get("http://python-sandbox/health")).json()
        assert health["isolation"]["network"] in ("namespace", "no_network")
        bad = await http.post("http://python-sandbox/v1/run", json={"code": 1})
        assert bad.status_code == 400 and "code" in bad.json()["error"]["message"]
    assert proc.poll() is None


async def test_an_unreachable_sandbox_server_is_a_tool_error_not_a_crash(tmp_path):
    client = PythonSandbox(sandbox_url=f"unix://{tmp_path / 'nobody-listens.sock'}")
    result = await client.call({"code": "print(1)"}, timeout_s=5)
    assert result.is_error and result.metadata["failure"] == "sandbox_unavailable", result


def test_a_process_without_network_sees_only_loopback():
    """What the launcher checks before it accepts ``no_network`` (a container with
    ``network_mode: none``): here a fresh network namespace made by ``unshare``."""
    code = "from tools._sandbox_launcher import network_interfaces; print(network_interfaces())"
    done = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "['lo']", done
    assert len(network_interfaces()) > 1  # and this machine's own namespace has more


async def test_the_server_refuses_to_start_where_it_cannot_isolate(tmp_path):
    """``asyncrl python-sandbox`` with settings it cannot honour exits 2 with the reason."""
    bad = await asyncio.create_subprocess_exec(sys.executable, "-m", "launcher", "python-sandbox", "--socket", str(tmp_path / "s.sock"),
                                               "--limits", json.dumps({"network_isolation": "audit_hook"}),
                                               stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(bad.communicate(), 60)
    assert bad.returncode == 2 and b"refusing to start" in err and b"audit_hook" in err


async def test_root_mode_runs_get_their_own_tmp_shm_and_proc(work_root, tmp_path):
    """Issue 30 item 9: in root mode each run has a fresh ``/tmp`` and ``/dev/shm`` (capped
    tmpfs, gone with the run: nothing one run leaves is seen by the next, nothing reaches the
    host's) and a procfs where only its own processes exist (no host command lines)."""
    from tools._sandbox_launcher import PRIVATE_TMPFS_BYTES

    sandbox = PythonSandbox(**{**TIGHT_LIMITS, "work_root": str(work_root)})
    marker = f"asyncrl-leak-{os.getpid()}"
    first = await sandbox.call({"code": textwrap.dedent(f"""
        import os
        for d in ('/tmp', '/dev/shm'):
            open(os.path.join(d, {marker!r}), 'w').write('x')
        shm = os.statvfs('/dev/shm')
        tmp = os.statvfs('/tmp')
        pids = [p for p in os.listdir('/proc') if p.isdigit()]
        mine = all(os.stat('/proc/' + p).st_uid == os.getuid() for p in pids)
        print('shm', shm.f_blocks * shm.f_frsize, 'tmp', tmp.f_blocks * tmp.f_frsize, 'pids', len(pids), 'mine', mine)
        print('host init visible', os.path.exists('/proc/1/cmdline'))
    """)}, timeout_s=10)
    assert not first.is_error, first
    iso = first.metadata["isolation"]
    assert iso["private_mounts"][:2] == ["/tmp", "/dev/shm"] and iso["private_mounts"][-1] == "/proc", iso
    assert f"shm {PRIVATE_TMPFS_BYTES} tmp {PRIVATE_TMPFS_BYTES}" in first.content, first.content
    assert "mine True" in first.content and "host init visible False" in first.content, first.content
    pids = int(first.content.split("pids ")[1].split()[0])
    assert 1 <= pids <= 3, first.content  # the launcher, the namespace's init, the program
    assert not os.path.exists(f"/tmp/{marker}") and not os.path.exists(f"/dev/shm/{marker}")
    second = await sandbox.call({"code": f"import os; print([os.path.exists(os.path.join(d, {marker!r})) for d in ('/tmp', '/dev/shm')])"},
                                timeout_s=10)
    assert second.content.strip() == "[False, False]", second
    assert sandbox_pids() == {}


async def test_root_mode_runs_see_no_run_directory_data_or_shared_world_writable_dirs(work_root, tmp_path):
    """Issue 48 items 5 and 10: a sandboxed program printed the ``ground_truth`` of the run's data
    export and read acked trajectories, and ``/var/tmp`` and the lock directories were shared
    with the host and between runs. Now the run directory and the data roots (``hidden_paths``)
    are empty and read-only in the run's mount namespace, and every world-writable directory is
    a fresh tmpfs of the run's own."""
    # outside /tmp (which the run gets fresh anyway): where a deployment keeps its run directory
    run_dir = Path(tempfile.mkdtemp(prefix="asyncrl-hidden-", dir="/var/lib")) / "run"
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data" / "train.jsonl").write_text('{"ground_truth": "42"}\n')
    (run_dir / "data").chmod(0o755)
    run_dir.chmod(0o755)
    run_dir.parent.chmod(0o755)
    (run_dir / "data" / "train.jsonl").chmod(0o644)  # readable by anyone on the host: hidden all the same
    shared = [d for d in ("/var/tmp", "/run/lock") if os.path.isdir(d)]
    marker = f"asyncrl-shared-{os.getpid()}"
    sandbox = PythonSandbox(**{**TIGHT_LIMITS, "work_root": str(work_root), "hidden_paths": [str(run_dir)]})
    out = await sandbox.call({"code": textwrap.dedent(f"""
        import os
        try:
            print('answer', open({str(run_dir / 'data' / 'train.jsonl')!r}).read().strip())
        except OSError as exc:
            print('hidden', type(exc).__name__)
        print('listing', os.listdir({str(run_dir)!r}))
        for d in {shared!r}:
            open(os.path.join(d, {marker!r}), 'w').write('x')
        print('wrote', len({shared!r}))
    """)}, timeout_s=10)
    assert not out.is_error, out
    assert "hidden FileNotFoundError" in out.content and "listing []" in out.content, out.content
    assert f"wrote {len(shared)}" in out.content, out.content
    assert not any(os.path.exists(os.path.join(d, marker)) for d in shared)  # nothing reached the host's
    assert set(shared) <= set(out.metadata["isolation"]["private_mounts"]), out.metadata["isolation"]
    assert str(run_dir) in out.metadata["isolation"]["private_mounts"]
    shutil.rmtree(run_dir.parent)
