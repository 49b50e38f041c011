"""The weight-update process group: one sender (rank 0, the trainer) and the engines' ranks.

This module owns group hosting for everyone: the trainer hosts (:func:`host_group`, gloo or
NCCL), local_engine joins (:func:`join_group`, gloo); SGLang joins with its own
``init_custom_process_group``. The group lives outside the trainer's torchrun world: rank 0
hosts a ``TCPStore`` bound to the master address itself (:mod:`asyncrl.listen`: 127.0.0.1 for a
loopback one, never every interface; issue 48), its gloo connections on that address too,
and the process group is built by hand on that store with the key prefixes torch's
``_new_process_group_helper`` uses (``<group>`` / ``<group>/`` / ``cpu/`` for gloo, ``cuda/``
for NCCL), so SGLang's side meets it. ``dist.broadcast(group=...)`` refuses hand-built
groups, so collectives go through ``pg.broadcast``.

Failure handling (the point of this module):

- every blocking step has its own timeout: forming (``timeout_s``) and each broadcast;
- blocking group calls made from a coroutine (hosting, joining, receiving) run in a daemon
  thread of their own (:func:`in_daemon_thread`, :func:`host_group_async`): a rendezvous or
  broadcast the caller gave up on waits out its timeout there without holding the event
  loop's shutdown or the process's exit (``asyncio.to_thread``'s executor would hold both:
  a trainer or engine told to stop would sit until the timeout);
- :meth:`WeightGroup.broadcast` waits on the collective's future and can be *cancelled*
  (a ``threading.Event``): the sync agent saw an engine refuse the bucket, so waiting for
  the collective to time out would only waste the timeout. A cancelled or timed-out
  broadcast marks the group broken (destroy it and form a new one on a new port). gloo
  cannot interrupt an operation already on the wire: it is abandoned and ends at its own
  timeout in gloo's thread; NCCL communicators are aborted (``pg.abort()``);
- an NCCL group is built with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up, do not tear
  down): torchrun starts the trainer with 1 (tear down the process on a timed-out
  collective), which would turn a failed weight sync into a dead trainer. Its own timeout
  is the broadcast's plus :data:`NCCL_WATCHDOG_SLACK_S`, so our own cancel always comes first.

Not covered here (no GPU on the development machine): the NCCL path is written to torch's
API but was not run; ``bench/gpu.py`` exercises CUDA without a second NCCL rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from asyncrl.listen import is_loopback, reserve_listen_socket
from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.wire.sync import DEFAULT_GROUP_NAME

T = TypeVar("T")

log = logging.getLogger(__name__)

# Forming the group waits for every engine to call in; an engine busy loading a model can
# take tens of seconds, a dead one never comes: fail after this.
DEFAULT_GROUP_TIMEOUT_S = 120.0
DESTROY_WAIT_S = 5.0  # destroy() waits this long for an ordinary shutdown before leaving it to its thread
# NCCL's own watchdog timeout exceeds ours by this much, so our cancel/timeout acts first.
NCCL_WATCHDOG_SLACK_S = 60.0
_ENV_LOCK = threading.Lock()  # the error-handling variable is read when an NCCL group is built


@dataclass
class WeightGroup:
    """A formed group. ``broadcast`` blocks: run it in a thread from async code."""

    pg: dist.ProcessGroup | None
    rank: int
    world_size: int
    group_name: str
    timeout_s: float
    backend: str = "gloo"
    _keep: list = field(default_factory=list, repr=False)  # the store stays alive with the group
    broken: str | None = None
    _abandoned: bool = field(default=False, repr=False)  # a gloo operation was left on the wire
    _abandoned_work: object = field(default=None, repr=False)
    """The abandoned operation's ``Work``: destroying it waits for the operation to end (up to
    its timeout), so it is kept here and dropped in :meth:`destroy`'s release thread, never in
    the thread that gave up on it."""

    @property
    def device(self) -> torch.device:
        """Where tensors for this group's collectives must live."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, timeout_s: float | None = None,
                  cancel: threading.Event | None = None) -> None:
        """Broadcast ``tensor`` in place from rank ``src``. Raises :class:`WeightSyncError` on
        failure, after ``timeout_s``, or as soon as ``cancel`` is set; the group is then broken."""
        if self.broken or self.pg is None:
            raise WeightSyncError(f"group {self.group_name!r} is broken ({self.broken}); destroy and re-form it")
        limit = self.timeout_s if timeout_s is None else timeout_s
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = src, 0, timedelta(seconds=limit)
        done = threading.Event()
        try:
            work = self.pg.broadcast([tensor], opts)
            work.get_future().add_done_callback(lambda _f: done.set())
        except Exception as exc:
            self.abort(f"{type(exc).__name__}: {exc}")
            raise WeightSyncError(f"broadcast in group {self.group_name!r} failed: {exc}") from exc
        # Every raise below first drops the local ``work``: the exception's traceback keeps this
        # frame alive for as long as anyone holds the exception (a future, a chained error), and
        # a live Work keeps the group's connections open after destroy(): the peers stay blocked
        # in their receive until this process lets go (seen: an engine stuck for the full
        # group timeout after its peer died mid-sync; tests/sync/test_weight_group_release.py).
        waited, step = 0.0, 0.05
        while not done.wait(step):
            waited += step
            if cancel is not None and cancel.is_set():
                self._abandoned, self._abandoned_work, work = True, work, None
                self.abort("cancelled")
                raise WeightSyncError(f"broadcast in group {self.group_name!r} cancelled")
            if waited >= limit:
                self._abandoned, self._abandoned_work, work = True, work, None
                self.abort(f"timed out after {limit:g} s")
                raise WeightSyncError(f"broadcast in group {self.group_name!r} timed out after {limit:g} s")
        try:
            work.wait()
        except Exception as exc:
            work = None
            self.abort(f"{type(exc).__name__}: {exc}")
            raise WeightSyncError(f"broadcast in group {self.group_name!r} failed: {exc}") from exc

    def abort(self, reason: str) -> None:
        """Mark the group broken and release what can be released now (NCCL: abort the
        communicators so pending work fails; gloo: pending work ends at its own timeout)."""
        self.broken = self.broken or reason
        if self.pg is not None and self.backend == "nccl":
            try:
                self.pg.abort()
            except Exception as exc:  # noqa: BLE001 - best effort on an already failing group
                log.debug("aborting group %s: %s", self.group_name, exc)

    def destroy(self) -> None:
        """Release the group's connections (idempotent, returns within :data:`DESTROY_WAIT_S`:
        a gloo group whose operation was abandoned — here, or by the peer that cancelled a
        broadcast this side was receiving — can only shut down once that operation ends at its
        own timeout, so the release runs in a daemon thread; an ordinary one is done before
        this returns)."""
        if self.pg is None:
            self.broken = self.broken or "destroyed"
            return
        # Every reference to the process group, its store and an abandoned operation moves into
        # ``held``; the release thread drops the last ones. Their C++ destructors wait for an
        # abandoned operation to end (up to its timeout): that wait must never happen here.
        held = {"work": self._abandoned_work, "pg": self.pg, "keep": self._keep}
        self.pg, self._keep, self._abandoned_work = None, [], None
        self.broken = self.broken or "destroyed"

        def release() -> None:
            held.pop("work")
            pg = held.pop("pg")
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - already torn down by a peer failure
                pass
            del pg
            held.clear()

        releasing = threading.Thread(target=release, name=f"release-{self.group_name}", daemon=True)
        releasing.start()
        if not self._abandoned:
            releasing.join(DESTROY_WAIT_S)
            if releasing.is_alive():
                log.warning("group %s: its connections are still shutting down (a peer's operation was abandoned); "
                            "released in the background", self.group_name)


def _store(master_address: str, master_port: int, world_size: int, rank: int, limit: timedelta,
           listen_socket: socket.socket | None) -> dist.TCPStore:
    if rank != 0:
        return dist.TCPStore(master_address, master_port, world_size, False, limit)
    if listen_socket is None:
        listen_socket = reserve_listen_socket(master_address, master_port)
    try:
        store = dist.TCPStore(master_address, master_port, world_size, True, limit,
                              wait_for_workers=False, multi_tenant=False, master_listen_fd=listen_socket.fileno())
    except Exception:
        listen_socket.close()
        raise
    # The store owns the fd now and closes it when it goes; closing the Python socket too
    # would be a double close that can hit an fd number reused meanwhile.
    listen_socket.detach()
    return store


def _gloo_pg(store, rank: int, world_size: int, group_name: str, limit: timedelta, address: str | None) -> dist.ProcessGroup:
    """``address``: where this rank's gloo connections listen (None: the interface
    ``GLOO_SOCKET_IFNAME`` names, else gloo's default device, the host name's address)."""
    prefixed = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = limit
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if address:
        device = dist.ProcessGroupGloo.create_device(hostname=address, lazy_init=False)
    elif interface:  # as torch's own gloo groups honour it
        device = dist.ProcessGroupGloo.create_device(interface=interface, lazy_init=False)
    else:
        device = dist.ProcessGroupGloo.create_default_device()
    opts._devices = [device]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)


def _nccl_pg(store, rank: int, world_size: int, group_name: str, limit: timedelta) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore("cuda/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = limit + timedelta(seconds=NCCL_WATCHDOG_SLACK_S)
    with _ENV_LOCK:
        before = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # CleanUpOnly: abort comms, keep the process
        try:
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        finally:
            if before is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = before


def _form(master_address: str, master_port: int, world_size: int, rank: int, *, backend: str, group_name: str,
          timeout_s: float, listen_socket: socket.socket | None) -> WeightGroup:
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"unknown weight-sync backend {backend!r} (gloo or nccl)")
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} outside world of size {world_size}")
    limit = timedelta(seconds=timeout_s)
    # the host's gloo connections listen where its store does; a joiner's on loopback or gloo's default
    gloo_address = "127.0.0.1" if is_loopback(master_address) else None
    try:
        if rank == 0 and listen_socket is None:
            listen_socket = reserve_listen_socket(master_address, master_port)
        if rank == 0:
            gloo_address = listen_socket.getsockname()[0]
        store = _store(master_address, master_port, world_size, rank, limit, listen_socket)
        pg = (_gloo_pg(store, rank, world_size, group_name, limit, gloo_address) if backend == "gloo"
              else _nccl_pg(store, rank, world_size, group_name, limit))
    except Exception as exc:
        raise WeightSyncError(f"forming {backend} weight group {group_name!r} (rank {rank}/{world_size} via "
                              f"{master_address}:{master_port}) failed: {exc}") from exc
    return WeightGroup(pg=pg, rank=rank, world_size=world_size, group_name=group_name, timeout_s=timeout_s,
                       backend=backend, _keep=[store])


def host_group(master_address: str, master_port: int, world_size: int, *, backend: str = "gloo",
               group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
               listen_socket: socket.socket | None = None) -> WeightGroup:
    """Host the group as rank 0; blocks until every rank joined (gloo) or the store is up
    (NCCL: communicators are created by the first collective). ``listen_socket`` is the
    reserved rendezvous socket (see :func:`reserve_listen_socket`)."""
    where = listen_socket.getsockname() if listen_socket is not None else (master_address, master_port)
    log.info("hosting weight group %r (%s, world size %d) on %s:%d", group_name, backend, world_size, where[0] or "*", where[1])
    return _form(master_address, master_port, world_size, 0, backend=backend, group_name=group_name,
                 timeout_s=timeout_s, listen_socket=listen_socket)


async def in_daemon_thread(fn: Callable[..., T], /, *args, name: str = "weight-sync", orphan: Callable[[T], None] | None = None,
                           **kwargs) -> T:
    """``fn(*args, **kwargs)`` from a coroutine, in a daemon thread of its own (module doc): a
    call the caller gave up on (a rendezvous or a broadcast waiting out its timeout) holds up
    neither the event loop's shutdown nor the process's exit, as ``asyncio.to_thread``'s
    executor would. Its result, if nobody takes it any more (the awaiting task was cancelled
    or the loop is gone), goes to ``orphan`` (e.g. destroying a group that formed too late)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def deliver(ok: bool, value) -> None:
        if done.cancelled():
            if ok and orphan is not None:
                orphan(value)
        elif ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def run() -> None:
        try:
            ok, value = True, fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
            ok, value = False, error
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:  # the loop is closed: nobody will take the result
            if ok and orphan is not None:
                orphan(value)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done


async def host_group_async(master_address: str, master_port: int, world_size: int, *, backend: str = "gloo",
                           group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                           listen_socket: socket.socket | None = None) -> WeightGroup:
    """:func:`host_group` from a coroutine, through :func:`in_daemon_thread`: a group that forms
    after its caller gave up is destroyed."""
    return await in_daemon_thread(host_group, master_address, master_port, world_size, backend=backend,
                                  group_name=group_name, timeout_s=timeout_s, listen_socket=listen_socket,
                                  name=f"host-{group_name}", orphan=WeightGroup.destroy)


def join_group(master_address: str, master_port: int, world_size: int, rank: int, *,
               group_name: str = DEFAULT_GROUP_NAME, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> WeightGroup:
    """Join a hosted gloo group as ``rank`` (> 0): what an engine does on
    ``/init_weights_update_group``. Blocks until every rank joined."""
    if rank == 0:
        raise WeightSyncError("rank 0 is the sender; engines join with rank_offset >= 1")
    return _form(master_address, master_port, world_size, rank, backend="gloo", group_name=group_name,
                 timeout_s=timeout_s, listen_socket=None)
