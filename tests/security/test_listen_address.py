"""Issue 48 item 3: the trainer's unauthenticated rendezvous ports listen on the master address,
never on every interface (a dual-homed node served 29500/29600 on its public interface while
``MASTER_ADDR`` was private). Probed on this machine's real interfaces (psutil): a non-loopback
address of its own, a weight group formed on it, torchrun through the wrapper."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

from asyncrl.listen import (
    ListenAddressError,
    bound_ifname_env,
    interface_of,
    reserve_listen_socket,
    socket_ifname_env,
)
from asyncrl.weight_sync import host_group, join_group

REPO = Path(__file__).resolve().parents[2]
GROUP_TIMEOUT_S = 60.0


def own_address() -> tuple[str, str]:
    """(interface, a non-loopback IPv4 address of this machine)."""
    for name, addrs in sorted(psutil.net_if_addrs().items(), key=lambda kv: (kv[0].startswith("docker"), kv[0])):
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return name, a.address
    raise AssertionError("these tests need a non-loopback IPv4 interface on the machine (none found)")


def listeners(pid: int | None = None) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_a_socket_for_a_non_loopback_master_binds_that_address_not_every_interface():
    _, ip = own_address()
    sock = reserve_listen_socket(ip)
    try:
        assert sock.getsockname()[0] == ip
    finally:
        sock.close()
    loop = reserve_listen_socket("localhost")
    try:
        assert loop.getsockname()[0] == "127.0.0.1"
    finally:
        loop.close()


@pytest.mark.parametrize(("address", "why"), [("203.0.113.7", "none an address of this host"),
                                              ("0.0.0.0", "unspecified address"), ("::", "unspecified address"),
                                              ("::ffff:0.0.0.0", "unspecified address"), ("::ffff:0:0", "unspecified address"),
                                              ("", "empty"), ("no-such-host.invalid", "does not resolve")])
def test_an_address_this_host_cannot_listen_on_is_an_error_that_says_what_to_set(address, why):
    with pytest.raises(ListenAddressError, match=why) as info:
        reserve_listen_socket(address)
    if "none an address" in why:
        assert "trainer.master_addr" in str(info.value) and address in str(info.value)


def test_a_weight_group_on_a_non_loopback_master_listens_only_there(monkeypatch):
    """Host a gloo group on this machine's own address with a joiner: every socket the process
    opened to listen (the store and gloo's connections) is on that address."""
    interface, ip = own_address()
    before = listeners()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)  # the joiner's gloo device (an engine sets its own)
    sock = reserve_listen_socket(ip)
    port = sock.getsockname()[1]
    joined: dict = {}

    def join() -> None:
        try:
            joined["group"] = join_group(ip, port, 2, 1, timeout_s=GROUP_TIMEOUT_S)
            buf = torch.zeros(4)
            joined["group"].broadcast(buf)
            joined["got"] = buf
        except Exception as exc:  # reported below
            joined["error"] = exc

    t = threading.Thread(target=join, daemon=True)
    t.start()
    group = host_group(ip, port, 2, timeout_s=GROUP_TIMEOUT_S, listen_socket=sock)
    try:
        opened = listeners() - before
        group.broadcast(torch.arange(4.0))
        t.join(GROUP_TIMEOUT_S)
        assert "error" not in joined, joined.get("error")
        assert torch.equal(joined["got"], torch.arange(4.0))
        assert (ip, port) in opened
        assert opened and all(addr == ip for addr, _ in opened), opened
    finally:
        group.destroy()
        if "group" in joined:
            joined["group"].destroy()


def test_gloo_and_nccl_are_told_the_interface_toward_the_master():
    interface, ip = own_address()
    assert interface_of(ip) == interface
    assert socket_ifname_env(ip, {}) == {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
    assert socket_ifname_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    # what the operator set stays
    assert socket_ifname_env(ip, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": interface}


def test_an_engine_bound_to_its_nodes_address_joins_weight_groups_from_that_interface():
    """A cluster node's engine listens on NODE_ADDR (compose.cluster.yaml): gloo's default device
    would be the host name's address (127.0.1.1 on Debian), which the trainer cannot reach."""
    interface, ip = own_address()
    assert bound_ifname_env(ip, {}) == {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}
    assert bound_ifname_env(ip, {"GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": interface}
    for host in ("127.0.0.1", "0.0.0.0", "::", "engine-1", "192.0.2.123"):  # loopback, any, a name, not ours
        assert bound_ifname_env(host, {}) == {}, host


WORKER = """
import json, os, sys
import psutil
port = int(os.environ["MASTER_PORT"])
agent = psutil.Process(os.getppid())
print(json.dumps(sorted({c.laddr.ip for c in agent.net_connections(kind="tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port})))
"""


def test_torchruns_store_listens_on_the_master_address(tmp_path):
    """torchrun's own agent store listens on ``::`` whatever ``--master-addr`` says; through
    ``trainer_daemon.torchrun`` it listens on the master address only (node 0)."""
    _, ip = own_address()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    sock = reserve_listen_socket(ip)
    port = sock.getsockname()[1]
    sock.close()
    done = subprocess.run([sys.executable, "-m", "trainer_daemon.torchrun", "--nproc-per-node", "1", "--master-addr", ip,
                           "--master-port", str(port), "--rdzv-backend", "static", str(script)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == [ip], seen


def test_a_host_name_that_resolves_to_loopback_here_is_bound_there_with_a_warning(monkeypatch, caplog):
    """Debian maps the host's own name to 127.0.1.1: the socket then listens there, which other
    hosts cannot reach, and the log says to give the node's address for a multi-host run."""
    real = socket.getaddrinfo

    def fake(host, *args, **kwargs):
        if host == "node0":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with caplog.at_level("WARNING", logger="asyncrl.listen"):
        sock = reserve_listen_socket("node0")
    try:
        assert sock.getsockname()[0] == "127.0.1.1"
    finally:
        sock.close()
    assert "loopback" in caplog.text and "trainer.master_addr" in caplog.text
