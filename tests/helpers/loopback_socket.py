"""A loopback listening port taken before an in-process server starts.

``free_port()`` finds a port that is free *now*; a server started on it later can lose it to
another process in between (CI once: "address already in use" for a test's sync agent, when
``free_port()`` still took its ports from the ephemeral range an outgoing connection had just
taken from; asyncrl/listen_ports.py now chooses below it). A socket bound here holds
the port from the start: pass it to ``uvicorn.Server.serve(sockets=[sock])``, which listens on
it, and close it after the server stops.
"""

from __future__ import annotations

import socket


def loopback_socket() -> socket.socket:
    """A TCP socket bound to 127.0.0.1 on a port the kernel chose (``sock.getsockname()[1]``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock
