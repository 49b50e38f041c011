"""Ports chosen for servers other processes start: below the kernel's ephemeral range (and
Kubernetes' NodePorts), free, distinct."""

from __future__ import annotations

import errno
import random
import socket

import pytest

from asyncrl.listen_ports import (
    LINUX_DEFAULT_EPHEMERAL_LOW,
    LISTEN_PORT_FLOOR,
    LISTEN_PORT_TOP,
    MIN_ROOM,
    distinct_free_ports,
    ephemeral_low,
    free_port,
)


class ScriptedPorts(random.Random):
    """Draws the given ports in order; a draw past them fails the test."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(0)
        self.ports = list(ports)

    def randrange(self, start, stop=None, step=1):  # noqa: ARG002 - random.Random's signature
        assert self.ports, "drew more ports than scripted"
        return self.ports.pop(0)


def kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ports_lie_below_the_kernels_ephemeral_range_so_no_outgoing_connection_takes_them():
    low = ephemeral_low()
    ports = distinct_free_ports(32)
    assert len(set(ports)) == 32  # distinct among themselves; a separate draw may meet one of them (none is held)
    ports.append(free_port())
    if min(low, LISTEN_PORT_TOP) - LISTEN_PORT_FLOOR >= MIN_ROOM:
        assert all(LISTEN_PORT_FLOOR <= p < min(low, LISTEN_PORT_TOP) for p in ports), (ports, low)
        assert kernel_port() >= low  # what bind to port 0 gives lies in the range avoided
    else:  # a host tuned to a low ephemeral range: the kernel's choice
        assert all(p >= low for p in ports), (ports, low)


def test_a_port_something_listens_on_is_never_chosen(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("40000\t60999\n")  # the scripted ports lie in the room below LISTEN_PORT_TOP
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        other = kernel_port()
        ports = distinct_free_ports(1, range_file=range_file, rng=ScriptedPorts([busy, other]))
    assert ports == [other]


def test_two_draws_of_the_same_port_give_distinct_ports(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("32768 60999\n")
    port = kernel_port()
    ports = distinct_free_ports(2, range_file=range_file, rng=ScriptedPorts([port, port, port + 1 if port < 60999 else port - 1]))
    assert len(set(ports)) == 2 and ports[0] == port


def test_a_host_whose_ephemeral_range_leaves_no_room_gets_the_kernels_choice(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text(f"{LISTEN_PORT_FLOOR + MIN_ROOM - 1} 65535\n")
    ports = distinct_free_ports(3, range_file=range_file, rng=ScriptedPorts([]))  # a draw would fail
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    # and an unreadable or garbled range file means Linux's default
    assert ephemeral_low(tmp_path / "missing") == LINUX_DEFAULT_EPHEMERAL_LOW
    range_file.write_text("garbled")
    assert ephemeral_low(range_file) == LINUX_DEFAULT_EPHEMERAL_LOW


def test_an_address_this_host_lacks_fails_at_once():
    with pytest.raises(OSError) as lacking:
        distinct_free_ports(1, "192.0.2.1", rng=ScriptedPorts([LISTEN_PORT_FLOOR]))  # TEST-NET-1: never local
    assert lacking.value.errno == errno.EADDRNOTAVAIL  # not "taken": a second draw would have failed the script


def test_an_ipv6_address_gets_an_ipv6_port():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"this host has no IPv6 loopback: {exc}")
    port = free_port("::1")
    assert LISTEN_PORT_FLOOR <= port
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
