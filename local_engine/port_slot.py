"""The engine's listening socket when replicas share a host's network: the first free port
of a range (``--port-slots``).

Replicas of one engine service that share a host's network (compose ``--scale`` with
``network_mode: host``, compose.cluster.yaml) cannot all listen on 30000. Each replica takes
the first port of ``port`` .. ``port + slots - 1`` that it can bind *and listen on*, in order:
with ``SO_REUSEADDR`` two sockets may both bind a port that nobody listens on yet, but only
one ``listen()`` succeeds, so bind-and-listen is the lock (two replicas starting at once never
share a port), and a replica that dies frees its port for the next one (no wait for
TIME_WAIT).

Contract of :func:`claim_port`: a socket listening on ``host`` at the first free port of the
range; :class:`PortsTaken` (message names the host and the range) when none is free; any
other bind error (an address that is not this host's, a port below 1024 without the right) is
raised as it is. The family follows uvicorn's rule: IPv6 when ``host`` contains ``:``, else
IPv4 (``localhost`` is 127.0.0.1). Limits: the socket listens from the claim on, so a client
that connects while the model still loads waits instead of being refused; an IPv6 address
with a zone id is written without URL escaping (give an address without one).
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

BACKLOG = 2048  # uvicorn's default
MAX_PORT = 65535


class PortsTaken(OSError):
    """Every port of the range is in use on this host."""


def _bind_and_listen(family: int, host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host``:``port``; None when the port is in use."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def claim_port(host: str, port: int, slots: int = 1) -> socket.socket:
    """Listen on the first free port of ``port`` .. ``port + slots - 1`` (module docstring)."""
    if not (0 <= port and port + max(slots, 1) - 1 <= MAX_PORT):
        raise ValueError(f"ports {port}..{port + slots - 1} are outside 0..{MAX_PORT}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    last = port + max(slots, 1) - 1
    for candidate in range(port, last + 1):
        sock = _bind_and_listen(family, address, candidate)
        if sock is not None:
            return sock
    raise PortsTaken(errno.EADDRINUSE, f"every port of {host}:{port}-{last} is in use: another engine holds each "
                     f"(at most {slots} replicas on this host; raise --port-slots for more)")


def write_address(path: str, sock: socket.socket) -> None:
    """``host:port`` of ``sock`` into ``path`` (replaced whole: a reader never sees half)."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(f"{shown}:{port}\n")
    partial.replace(target)
