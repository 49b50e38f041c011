"""Choosing a TCP port for a server that another process will start.

A launcher picks a port, passes it to a child (an engine, the rollout service, NATS) and the
child binds it a moment later. In between, the port must not be taken. The usual trick — bind
to port 0, read the kernel's choice, close — returns a port from the kernel's *ephemeral
range* (``/proc/sys/net/ipv4/ip_local_port_range``, 32768–60999 by default), the range every
outgoing connection takes its local port from: any ``connect()`` on the host can take it before
the child binds it, and the child fails with "address already in use" (seen in this project's
CI on a busy machine).

So the ports here come from below that range (``LISTEN_PORT_FLOOR`` up to its start), where
the kernel never hands out a port by itself: only another explicit ``bind`` can take one. Each
port is checked free when chosen (a bind to it succeeds) and chosen at random, so two launchers
choosing at once rarely meet; where the range starts too low to leave room (a host configured
with ``1024 65535``), the choice falls back to the kernel's.

Limits: a port is free *when chosen*, not reserved. A caller that can start its server on a
socket it already holds should do that instead (``tests/helpers/loopback_socket.py``).
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL_LOW = 32768
LISTEN_PORT_FLOOR = 10000  # above the registered ports most services listen on (NATS 4222, Postgres 5432, …)
MIN_ROOM = 1000  # fewer ports than this below the ephemeral range: use the kernel's choice
TRIES = 64


def ephemeral_low(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_DEFAULT_EPHEMERAL_LOW


def _bound(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host:port``, or None when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


def _kernel_choice(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock


def distinct_free_ports(n: int, host: str = "127.0.0.1", *, range_file: Path = EPHEMERAL_RANGE_FILE,
                        rng: random.Random | None = None) -> list[int]:
    """``n`` different ports free on ``host`` a moment ago (``0.0.0.0``: on every interface),
    below the ephemeral range where it leaves room. They are held together while chosen, so no
    two are the same."""
    rng = rng or random.SystemRandom()
    top = ephemeral_low(range_file)
    room = top - LISTEN_PORT_FLOOR >= MIN_ROOM
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < n:
            sock = None
            if room:
                for _ in range(TRIES):
                    sock = _bound(host, rng.randrange(LISTEN_PORT_FLOOR, top))
                    if sock is not None:
                        break
            sock = held.enter_context(sock or _kernel_choice(host))
            ports.append(sock.getsockname()[1])
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on ``host`` a moment ago, chosen as :func:`distinct_free_ports` does."""
    return distinct_free_ports(1, host)[0]
