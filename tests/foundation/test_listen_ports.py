"""Ports chosen for servers other processes start: below the kernel's ephemeral range, free, distinct."""

from __future__ import annotations

import random
import socket

from asyncrl.listen_ports import (
    LINUX_DEFAULT_EPHEMERAL_LOW,
    LISTEN_PORT_FLOOR,
    distinct_free_ports,
    ephemeral_low,
    free_port,
)


class Sequence(random.Random):
    """Hands out the given ports in order, then the floor upwards."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__(0)
        self.ports = list(ports)

    def randrange(self, start, stop=None, step=1):  # noqa: ARG002 - random.Random's signature
        return self.ports.pop(0) if self.ports else start


def test_ports_lie_below_the_kernels_ephemeral_range_so_no_outgoing_connection_takes_them():
    low = ephemeral_low()
    ports = distinct_free_ports(32)
    assert len(set(ports)) == 32
    assert all(LISTEN_PORT_FLOOR <= p < low for p in ports), (ports, low)
    assert LISTEN_PORT_FLOOR <= free_port() < low
    # the kernel's own choice (what bind to port 0 gives) is inside the range this avoids
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low


def test_a_port_something_listens_on_is_never_chosen(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        range_file = tmp_path / "range"
        range_file.write_text(f"{busy + 5000}\t{busy + 10000}\n")  # the busy port lies in the range chosen from
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            other = probe.getsockname()[1]
        ports = distinct_free_ports(1, range_file=range_file, rng=Sequence([busy, other]))
    assert ports == [other]


def test_two_draws_of_the_same_port_give_distinct_ports(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text(f"{LISTEN_PORT_FLOOR + 20000} 60999\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ports = distinct_free_ports(2, range_file=range_file, rng=Sequence([port, port, port + 1 if port < 60999 else port - 1]))
    assert len(set(ports)) == 2 and ports[0] == port


def test_a_host_whose_ephemeral_range_leaves_no_room_gets_the_kernels_choice(tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("1024 65535\n")
    ports = distinct_free_ports(3, range_file=range_file, rng=Sequence([]))
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    # and an unreadable or garbled range file means Linux's default
    assert ephemeral_low(tmp_path / "missing") == LINUX_DEFAULT_EPHEMERAL_LOW
    range_file.write_text("garbled")
    assert ephemeral_low(range_file) == LINUX_DEFAULT_EPHEMERAL_LOW
