"""``--port-slots`` with ``--slot-dir``: replicas sharing a host's network each lock the first
free slot and listen on exactly its port (compose.cluster.yaml's engine-cpu under ``--scale``);
a full range is refused naming it; a slot's port held by anything but a replica stops the engine
instead of moving it (issue 67 L6: clients call the configured port, whose holder would get the
engine key); the real engine process serves on its slot's port and writes it where its
healthcheck reads it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from asyncrl.launch import ChildProcess, free_port, http_ok
from local_engine.port_slot import PortSquatted, PortsTaken, claim_port, write_address
from local_engine.settings import EngineSettings, SettingsError
from tests.helpers.processes import ENGINE_START_TIMEOUT_S


def _squatter(port: int) -> socket.socket:
    """A listener that is not a replica (it holds no slot lock)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1)
    return sock


def test_replicas_take_the_next_free_slot_and_a_full_range_is_refused(tmp_path):
    first = free_port()  # another process may hold a port of the range: the slot decides, not the port
    taken = [claim_port("127.0.0.1", first, 2, tmp_path) for _ in range(2)]
    try:
        ports = [sock.getsockname()[1] for sock, _ in taken]
        assert ports == [first, first + 1], ports
        write_address(str(tmp_path / "addr"), taken[1][0])
        assert (tmp_path / "addr").read_text() == f"127.0.0.1:{first + 1}\n"
        with pytest.raises(PortsTaken, match=rf"every slot of 127\.0\.0\.1:{first}-{first + 1} is held"):
            claim_port("127.0.0.1", first, 2, tmp_path)
        for part in taken[0]:  # a replica that died frees its slot (its lock) and its port
            part.close()
        taken[0] = claim_port("127.0.0.1", first, 2, tmp_path)
        assert taken[0][0].getsockname()[1] == first
    finally:
        for sock, lock in taken:
            sock.close()
            lock.close()


def test_a_squatter_on_a_slots_port_stops_the_engine_instead_of_moving_it(tmp_path):
    first = free_port()
    squatter = _squatter(first)
    try:
        with pytest.raises(PortSquatted, match=rf"127\.0\.0\.1:{first} \(slot 0's port\) is in use by a process that "
                                               r"is not an engine replica"):
            claim_port("127.0.0.1", first, 3, tmp_path)
        with pytest.raises(PortSquatted, match="its port"):  # one slot, no slot dir: the port exactly
            claim_port("127.0.0.1", first)
        held, lock = claim_port("127.0.0.1", first + 1, 2, tmp_path / "other")  # the lock was given back on refusal
        held.close()
        lock.close()
    finally:
        squatter.close()
    sock, lock = claim_port("127.0.0.1", first, 3, tmp_path)  # the squatter gone: slot 0 again
    assert sock.getsockname()[1] == first
    sock.close()
    lock.close()


def test_a_range_past_the_last_port_or_without_a_slot_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        claim_port("127.0.0.1", 65535, 2, tmp_path)
    with pytest.raises(ValueError, match="slot_dir"):
        claim_port("127.0.0.1", free_port(), 2)
    with pytest.raises(SettingsError, match="port_slots"):
        EngineSettings.from_argv(["--port", "65535", "--port-slots", "2", "--slot-dir", str(tmp_path)], environ={})
    with pytest.raises(SettingsError, match="needs slot_dir"):
        EngineSettings.from_argv(["--port-slots", "2"], environ={})


def test_an_address_of_another_host_is_not_a_taken_port(tmp_path):
    with pytest.raises(OSError) as exc:
        claim_port("192.0.2.123", free_port(), 3, tmp_path)  # TEST-NET-1: never this host's
    assert not isinstance(exc.value, PortsTaken | PortSquatted)


def _engine(tmp_path, first: int, addr_file):
    argv = [sys.executable, "-m", "local_engine", "--model", "builtin:tiny", "--port", str(first), "--port-slots", "3",
            "--slot-dir", str(tmp_path / "slots"), "--addr-file", str(addr_file), "--torch-threads", "1",
            "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCAL_ENGINE_")}
    return argv, env


def test_the_engine_serves_on_its_slots_port_and_writes_it(tmp_path):
    first = free_port()
    replica = claim_port("127.0.0.1", first, 3, tmp_path / "slots")  # another replica holds slot 0
    addr_file = tmp_path / "addr"
    argv, env = _engine(tmp_path, first, addr_file)
    proc = ChildProcess("engine", argv, tmp_path / "engine.log", env=env).start()
    try:
        proc.wait_ready(lambda: addr_file.exists() and http_ok(f"http://{addr_file.read_text().strip()}/health"),
                        ENGINE_START_TIMEOUT_S)
        assert addr_file.read_text().strip() == f"127.0.0.1:{first + 1}"
    finally:
        proc.stop()
        for part in replica:
            part.close()


def test_the_engine_exits_2_when_its_slots_port_is_squatted(tmp_path):
    first = free_port()
    squatter = _squatter(first)
    try:
        argv, env = _engine(tmp_path, first, tmp_path / "addr")
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    finally:
        squatter.close()
    assert proc.returncode == 2 and "is in use by a process that is not an engine replica" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "addr").exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["--addr-file", "/proc/no-such-dir/addr"], "cannot write --addr-file /proc/no-such-dir/addr"),
    (["--port", "65535", "--port-slots", "2", "--slot-dir", "/tmp"], "port_slots"),
])
def test_bad_port_settings_exit_2_with_a_line_not_a_traceback(argv, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCAL_ENGINE_")}
    port = [] if "--port" in argv else ["--port", str(free_port())]
    proc = subprocess.run([sys.executable, "-m", "local_engine", *port, *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
