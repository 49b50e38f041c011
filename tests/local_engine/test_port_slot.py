"""``--port-slots``: replicas sharing a host's network each listen on the next free port of
the range (compose.cluster.yaml's engine-cpu under ``--scale``); a full range is refused
naming it; the real engine process serves on the port it took and writes it where its
healthcheck reads it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from asyncrl.launch import ChildProcess, free_port, http_ok
from local_engine.port_slot import PortsTaken, claim_port, write_address
from local_engine.settings import EngineSettings, SettingsError
from tests.helpers.processes import ENGINE_START_TIMEOUT_S


def test_replicas_take_the_next_free_port_and_a_full_range_is_refused(tmp_path):
    first = free_port()  # another process may hold a port of the range: only the order is asserted
    taken = [claim_port("127.0.0.1", first, 3) for _ in range(2)]
    try:
        ports = [s.getsockname()[1] for s in taken]
        assert ports[0] == first and first < ports[1] < first + 3, ports
        write_address(str(tmp_path / "addr"), taken[1])
        assert (tmp_path / "addr").read_text() == f"127.0.0.1:{ports[1]}\n"
        with pytest.raises(PortsTaken, match=rf"127\.0\.0\.1:{first}-{first} is in use"):
            claim_port("127.0.0.1", first, 1)
        taken[0].close()  # a replica that died frees its port for the next one
        taken[0] = claim_port("127.0.0.1", first, 1)
        assert taken[0].getsockname()[1] == first
    finally:
        for s in taken:
            s.close()


def test_a_range_past_the_last_port_is_refused():
    with pytest.raises(ValueError, match="outside"):
        claim_port("127.0.0.1", 65535, 2)
    with pytest.raises(SettingsError, match="port_slots"):
        EngineSettings.from_argv(["--port", "65535", "--port-slots", "2"], environ={})


def test_an_address_of_another_host_is_not_a_taken_port():
    with pytest.raises(OSError) as exc:
        claim_port("192.0.2.123", free_port(), 3)  # TEST-NET-1: never this host's
    assert not isinstance(exc.value, PortsTaken)


def test_the_engine_serves_on_the_port_it_claimed_and_writes_it(tmp_path):
    first = free_port()
    blocker = socket.socket()  # another replica holds the first port
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    blocker.bind(("127.0.0.1", first))
    blocker.listen(1)
    addr_file = tmp_path / "addr"
    argv = [sys.executable, "-m", "local_engine", "--model", "builtin:tiny", "--port", str(first), "--port-slots", "3",
            "--addr-file", str(addr_file), "--torch-threads", "1", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCAL_ENGINE_")}
    proc = ChildProcess("engine", argv, tmp_path / "engine.log", env=env).start()
    try:
        proc.wait_ready(lambda: addr_file.exists() and http_ok(f"http://{addr_file.read_text().strip()}/health"),
                        ENGINE_START_TIMEOUT_S)
        host, port = addr_file.read_text().strip().split(":")
        assert host == "127.0.0.1" and first < int(port) < first + 3
    finally:
        proc.stop()
        blocker.close()


@pytest.mark.parametrize(("argv", "says"), [
    (["--port-slots", "2", "--addr-file", "/proc/no-such-dir/addr"], "cannot write --addr-file /proc/no-such-dir/addr"),
    (["--port", "65535", "--port-slots", "2"], "port_slots"),
])
def test_bad_port_settings_exit_2_with_a_line_not_a_traceback(argv, says):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCAL_ENGINE_")}
    port = [] if "--port" in argv else ["--port", str(free_port())]
    proc = subprocess.run([sys.executable, "-m", "local_engine", *port, *argv], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
