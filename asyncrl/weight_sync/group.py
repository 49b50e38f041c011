"""A weight-update process group between one sender (rank 0) and inference engines.

The sender (trainer rank 0, or a test script) hosts the rendezvous ``TCPStore``; engines
join with ranks ``rank_offset .. rank_offset + tp - 1`` (SGLang's ``/init_weights_update_group``).
The group is built by hand — ``PrefixStore`` + ``ProcessGroupGloo(store, rank, size,
options)`` — because a torchrun trainer cannot add an outside process to its default
world, and ``dist.broadcast(group=...)`` refuses hand-built groups; collectives go through
``pg.broadcast([t], opts).wait()`` instead (see :meth:`WeightGroup.broadcast`).

Store keys are prefixed the way SGLang's ``init_custom_process_group`` and torch's
``_new_process_group_helper`` prefix them (``<group>`` / ``<group>/`` / ``cpu/``), so both
sides of a gloo group can be this module or that code.

Loopback: when the master address is loopback, the sender's store listens on 127.0.0.1
only (a socket bound there and handed over with ``master_listen_fd``) and gloo devices use
127.0.0.1; otherwise the store listens on all interfaces, like torch's default.

Every blocking call has a timeout: forming the group (``timeout_s``) and each broadcast.
Not covered here: NCCL (GPU) groups — ``backend="nccl"`` raises; the GPU path builds its
group with SGLang's helpers.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "weight_update_group"
# Forming the group waits for every engine to call in; an engine busy loading a model
# can take tens of seconds, a dead one never comes: fail after this.
DEFAULT_GROUP_TIMEOUT_S = 120.0


class WeightSyncError(RuntimeError):
    """Forming the group or a broadcast failed or timed out."""


def is_loopback(address: str) -> bool:
    """True for ``localhost`` and loopback IPs (127.0.0.0/8, ::1)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def reserve_listen_socket(address: str, port: int = 0) -> socket.socket:
    """Bind and listen on the rendezvous port before announcing it (``port=0``: pick one).

    Bound to 127.0.0.1 when ``address`` is loopback, to all interfaces otherwise. Pass the
    socket to :func:`init_weight_group` as ``listen_socket`` (rank 0 only); read the port
    with ``sock.getsockname()[1]``.
    """
    host = "127.0.0.1" if is_loopback(address) else ""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass
class WeightGroup:
    """A formed group. ``broadcast`` is blocking; run it in a thread from async code."""

    pg: dist.ProcessGroup
    rank: int
    world_size: int
    group_name: str
    timeout_s: float
    _keep: list = field(default_factory=list, repr=False)  # store and socket stay alive with the group
    broken: str | None = None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None) -> None:
        """Broadcast ``tensor`` in place from rank ``src``; raise :class:`WeightSyncError` on
        failure or timeout (the group is then marked broken and must be re-formed)."""
        if self.broken:
            raise WeightSyncError(f"group {self.group_name!r} is broken ({self.broken}); destroy and re-form it")
        limit = timedelta(seconds=self.timeout_s if timeout_s is None else timeout_s)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = limit
        try:
            self.pg.broadcast([tensor], opts).wait(limit)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            raise WeightSyncError(f"broadcast in group {self.group_name!r} failed: {exc}") from exc

    def destroy(self) -> None:
        """Release the group's connections (idempotent)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except Exception:  # already torn down by a peer failure
                pass
        for item in self._keep:
            if isinstance(item, socket.socket):
                item.close()
        self._keep.clear()
        self.broken = self.broken or "destroyed"


def init_weight_group(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    *,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    listen_socket: socket.socket | None = None,
) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the group; blocks until every rank has joined.

    Rank 0 hosts the store on ``master_port`` (on ``listen_socket`` if given, which must be
    bound to that port). Raises :class:`WeightSyncError` on timeout or connection failure.
    """
    if backend != "gloo":
        raise WeightSyncError(f"backend {backend!r} is not supported here (gloo only on CPU)")
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} outside world of size {world_size}")
    limit = timedelta(seconds=timeout_s)
    keep: list = []
    try:
        if rank == 0:
            fd = None
            if listen_socket is None and is_loopback(master_address):
                listen_socket = reserve_listen_socket(master_address, master_port)
            if listen_socket is not None:
                keep.append(listen_socket)
                fd = listen_socket.fileno()
            store = dist.TCPStore(
                master_address, master_port, world_size, True, limit,
                wait_for_workers=False, multi_tenant=False, master_listen_fd=fd,
            )
            if listen_socket is not None:
                # The store now owns the fd and closes it when it goes; closing the Python socket
                # too would be a double close that can hit an fd number reused meanwhile.
                keep.remove(listen_socket)
                listen_socket.detach()
        else:
            store = dist.TCPStore(master_address, master_port, world_size, False, limit)
        keep.append(store)
        prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = limit
        host = "127.0.0.1" if is_loopback(master_address) else ""
        device = dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False) if host else dist.ProcessGroupGloo.create_default_device()
        opts._devices = [device]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    except Exception as exc:
        for item in keep:
            if isinstance(item, socket.socket):
                item.close()
        raise WeightSyncError(f"forming weight group {group_name!r} (rank {rank}/{world_size} via {master_address}:{master_port}) failed: {exc}") from exc
    return WeightGroup(pg=pg, rank=rank, world_size=world_size, group_name=group_name, timeout_s=timeout_s, _keep=keep)
