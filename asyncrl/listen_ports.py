"""Choosing a TCP port for a server that another process will start.

A launcher picks a port, passes it to a child (an engine, the rollout service, NATS) and the
child binds it a moment later. In between, the port must not be taken. The usual trick — bind
to port 0, read the kernel's choice, close — returns a port from the kernel's *ephemeral
range* (``/proc/sys/net/ipv4/ip_local_port_range``, 32768–60999 by default), the range every
outgoing connection takes its local port from: any ``connect()`` on the host can take it before
the child binds it, and the child fails with "address already in use" (seen in this project's
CI on a busy machine).

So the ports here come from below that range, ``LISTEN_PORT_FLOOR`` up to ``LISTEN_PORT_TOP``
(or the range's start when lower), where Linux never hands out a port by itself: only another
explicit ``bind`` can take one. The top stays under 30000, where Kubernetes' NodePorts begin:
kube-proxy forwards those without a listening socket, so a free-looking port there may still be
a cluster service's. Each port is checked free when chosen (a bind to it succeeds) and chosen at
random, so two launchers choosing at once rarely meet; where the range starts too low to leave
room (a host tuned to ``1024 65535``), the choice falls back to the kernel's. Hosts that read no
``/proc`` (macOS: its range starts at 49152) are taken to start at Linux's 32768.

Limits: a port is free *when chosen*, not reserved; choose a process's ports in one call so they
differ. A caller that can start its server on a socket it already holds should do that instead
(``tests/helpers/loopback_socket.py``). Firewalled clusters must allow the services' ports in
this range between their nodes.
"""

from __future__ import annotations

import contextlib
import errno
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_EPHEMERAL_LOW = 32768
LISTEN_PORT_FLOOR = 10000  # above the registered ports most services listen on (NATS 4222, Postgres 5432, …)
LISTEN_PORT_TOP = 30000  # below Kubernetes' NodePort range (30000-32767)
MIN_ROOM = 1000  # fewer ports than this to choose from: use the kernel's choice
TRIES = 64  # random draws before the kernel's choice; each taken with probability (ports in use / room)
TAKEN = (errno.EADDRINUSE, errno.EACCES)


def ephemeral_low(range_file: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return LINUX_DEFAULT_EPHEMERAL_LOW


def _socket(host: str) -> socket.socket:
    return socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)


def _bound(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host:port``, or None when the port is taken. Any other failure (an
    address this host does not have) raises at once."""
    sock = _socket(host)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno in TAKEN:
            return None
        raise
    return sock


def _kernel_choice(host: str) -> socket.socket:
    sock = _socket(host)
    sock.bind((host, 0))
    return sock


def distinct_free_ports(n: int, host: str = "127.0.0.1", *, range_file: Path = EPHEMERAL_RANGE_FILE,
                        rng: random.Random | None = None) -> list[int]:
    """``n`` different ports free on ``host`` a moment ago (``0.0.0.0``: on every interface; an
    address with ``:`` is IPv6), below the ephemeral range where it leaves room. They are held
    together while chosen, so no two are the same."""
    rng = rng or random.SystemRandom()
    top = min(ephemeral_low(range_file), LISTEN_PORT_TOP)
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


def port_taken(host: str, port: int) -> bool:
    """Whether a server could not bind ``host:port`` now because another socket holds it. Bound
    as the servers bind (``SO_REUSEADDR``, as uvicorn and nats-server do), so a port a closed
    server left in TIME_WAIT is free. Any other failure (an address this host does not have, a
    privileged port) raises ``OSError``."""
    with _socket(host) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on ``host`` a moment ago, chosen as :func:`distinct_free_ports` does."""
    return distinct_free_ports(1, host)[0]
