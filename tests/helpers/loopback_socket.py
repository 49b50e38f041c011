"""A loopback listening port taken before an in-process server starts.

``free_port()`` finds a port that is free *now*; a server started on it later can lose it to
another process in between (CI once: "address already in use" for a test's sync agent, when
``free_port()`` still took its ports from the ephemeral range an outgoing connection had just
taken from; asyncrl/listen_ports.py now chooses below it). A socket bound here holds
the port from the start: :func:`serving` runs an app on it in the test's event loop
(``uvicorn.Server.serve(sockets=[sock])`` listens on it) and closes it after the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator


def loopback_socket() -> socket.socket:
    """A TCP socket bound to 127.0.0.1 on a port the kernel chose (``sock.getsockname()[1]``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


SERVER_START_S = 20.0  # uvicorn listening on a held socket, once its app is built


@contextlib.asynccontextmanager
async def serving(sock: socket.socket, app, what: str) -> AsyncIterator[None]:
    """Serve ``app`` with uvicorn on ``sock`` (from :func:`loopback_socket`) in this event loop
    until the block ends; then stop the server (60 s at most) and close the socket. ``what``
    names the server in the start-up failure."""
    import uvicorn

    from asyncrl.http.keepalive import SERVER_KEEP_ALIVE_S
    from tests.helpers.waiting import wait_for

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=sock.getsockname()[1], log_level="warning",
                                           lifespan="on", timeout_keep_alive=SERVER_KEEP_ALIVE_S))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await wait_for(lambda: server.started or task.done(), SERVER_START_S, f"{what}'s HTTP server to start")
        assert server.started, f"{what}'s HTTP server exited during startup: {task}"
        yield
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 60)
        finally:
            sock.close()
