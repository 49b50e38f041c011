"""The engine's listening socket: the first free port of a range (``--port-slots``).

Replicas of one engine service that share a host's network (compose ``--scale`` with
``network_mode: host``, compose.cluster.yaml) cannot all listen on 30000. Each replica binds
the first port of ``port`` .. ``port + slots - 1`` that is free, in order: the kernel's bind is
the lock (two replicas starting at once never get the same port), and a replica that dies
frees its port for the next one (``SO_REUSEADDR``: no wait for TIME_WAIT).

Contract of :func:`claim_port`: returns a socket bound to ``host`` on the first free port,
already listening; raises :class:`PortsTaken` (message names the host and the range) when none
is free; any other bind error (an address that is not this host's, a port below 1024 without
the right) is raised as it is. ``port`` 0 (one slot) asks the kernel for a free port.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

BACKLOG = 2048  # uvicorn's default


class PortsTaken(OSError):
    """Every port of the range is in use on this host."""


def claim_port(host: str, port: int, slots: int = 1) -> socket.socket:
    family, kind, proto, _, _ = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    last = port + max(slots, 1) - 1
    for candidate in range(port, last + 1):
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, candidate))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                continue
            raise
        sock.listen(BACKLOG)
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
