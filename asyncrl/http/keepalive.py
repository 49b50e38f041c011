"""Idle keep-alive of asyncrl's HTTP servers and clients: a client drops an idle pooled
connection well before the server closes it.

A client that reuses a pooled connection at the moment the server closes it for being idle
gets "connection reset by peer" (or ``ServerDisconnectedError``) on a request the server never
read. Seen under load on the trainer's ``POST /v1/syncs`` to the sync agent (uvicorn closes
idle connections after 5 s by default, aiohttp keeps them 15 s). So every asyncrl server keeps
idle connections ``SERVER_KEEP_ALIVE_S`` and every asyncrl client at most
``CLIENT_KEEPALIVE_S``; the gap covers a busy event loop on either side. Clients talking to
servers that are not asyncrl's (SGLang: uvicorn's 5 s) are covered by the same 3 s.
"""

from __future__ import annotations

import aiohttp

SERVER_KEEP_ALIVE_S = 30  # uvicorn timeout_keep_alive of the rollout service, the sync agent, local_engine
CLIENT_KEEPALIVE_S = 3.0  # aiohttp keepalive_timeout of every asyncrl client


def client_session(limit: int = 100, **kwargs) -> aiohttp.ClientSession:
    """An ``aiohttp.ClientSession`` whose pooled connections idle at most ``CLIENT_KEEPALIVE_S``."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=CLIENT_KEEPALIVE_S), **kwargs)


def unix_client_session(path: str, limit: int = 100, **kwargs) -> aiohttp.ClientSession:
    """:func:`client_session` over the unix socket at ``path`` (the python sandbox server)."""
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path, limit=limit, keepalive_timeout=CLIENT_KEEPALIVE_S),
                                 **kwargs)
