"""The engine's listening socket when replicas share a host's network: a *slot* of a port range
(``--port-slots``), claimed by a lock in a directory the replicas share (``--slot-dir``).

Replicas of one engine service that share a host's network (compose ``--scale`` with
``network_mode: host``, compose.cluster.yaml) cannot all listen on 30000. Each replica takes
the first slot ``k`` of ``0 .. slots - 1`` whose lock file ``<slot dir>/slot-<k>`` it can lock
(``flock``, held for the process's life: a replica that dies frees its slot), then listens on
exactly ``port + k``, as docker/sglang/engine.sh's GPU slots do. If that port is in use, the
holder is not a replica (replicas hold the slot's lock before they bind): the engine **refuses
to start** (:class:`PortSquatted`) rather than move on. Clients call the URLs the operator
configured (``engines.urls``); an engine that moved silently to the next port (issue 67 L6:
what bind-and-listen as the lock did) would leave whatever listens on its configured port to
receive the engine keys.

Contract of :func:`claim_port`: with ``slots`` 1 and no slot dir, a socket listening on exactly
``host:port`` (in use: :class:`PortSquatted`); with a slot dir, a socket on ``port + k`` of the
first free slot ``k`` and the open lock file (keep it open); :class:`PortsTaken` (message names
the host and the range) when every slot is locked; any other bind error (an address that is not
this host's, a port below 1024 without the right) is raised as it is. ``slots`` > 1 needs a
slot dir (ValueError). The family follows uvicorn's rule: IPv6 when ``host`` contains ``:``,
else IPv4 (``localhost`` is 127.0.0.1). Limits: the socket listens from the claim on, so a
client that connects while the model still loads waits instead of being refused; an IPv6
address with a zone id is written without URL escaping (give an address without one); the
slot dir must be one the replicas share and others cannot write (compose: a volume).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path
from typing import IO

BACKLOG = 2048  # uvicorn's default
MAX_PORT = 65535


class PortsTaken(OSError):
    """Every slot of the range is held by another replica on this host."""


class PortSquatted(OSError):
    """The port of this engine's slot is in use by a process that holds no slot."""


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


def _lock_slot(slot_dir: Path, slot: int) -> IO | None:
    """The open, locked lock file of ``slot``; None when another replica holds it."""
    f = open(slot_dir / f"slot-{slot}", "a")  # noqa: SIM115 - kept open: the lock lives as long as it
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def _squatted(host: str, port: int, slot: int | None) -> PortSquatted:
    which = "its port" if slot is None else f"slot {slot}'s port"
    return PortSquatted(errno.EADDRINUSE, f"{host}:{port} ({which}) is in use by a process that is not an engine replica "
                        "(it holds no slot): refusing to listen elsewhere, since clients call the configured port and "
                        "its holder would receive the engine key; stop what listens there, or configure another port")


def claim_port(host: str, port: int, slots: int = 1, slot_dir: str | Path | None = None) -> tuple[socket.socket, IO | None]:
    """The listening socket and the held slot lock (module docstring)."""
    slots = max(slots, 1)
    if not (0 <= port and port + slots - 1 <= MAX_PORT):
        raise ValueError(f"ports {port}..{port + slots - 1} are outside 0..{MAX_PORT}")
    if slots > 1 and slot_dir is None:
        raise ValueError("port_slots > 1 needs slot_dir: a directory the replicas share, where each locks its slot")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    if slot_dir is None:
        sock = _bind_and_listen(family, address, port)
        if sock is None:
            raise _squatted(host, port, None)
        return sock, None
    directory = Path(slot_dir)
    os.makedirs(directory, exist_ok=True)
    for slot in range(slots):
        lock = _lock_slot(directory, slot)
        if lock is None:
            continue
        try:
            sock = _bind_and_listen(family, address, port + slot)
        except BaseException:
            lock.close()
            raise
        if sock is None:
            lock.close()
            raise _squatted(host, port + slot, slot)
        return sock, lock
    raise PortsTaken(errno.EADDRINUSE, f"every slot of {host}:{port}-{port + slots - 1} is held by another engine "
                     f"replica (at most {slots} replicas on this host; raise --port-slots for more)")


def write_address(path: str, sock: socket.socket) -> None:
    """``host:port`` of ``sock`` into ``path`` (replaced whole: a reader never sees half)."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(f"{shown}:{port}\n")
    partial.replace(target)
