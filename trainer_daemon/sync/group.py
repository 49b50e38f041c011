"""The trainer↔engines weight group for both backends: gloo (CPU, via
:func:`asyncrl.weight_sync.init_weight_group`) and NCCL (GPU, built here the same way).

The group lives outside the trainer's torchrun world: rank 0 of the trainer hosts a
``TCPStore`` (on 127.0.0.1 only when the address is loopback), engines join with ranks
``1..world_size-1`` (SGLang's ``/init_weights_update_group``), and the process group is built by
hand on that store with the key prefixes ``torch.distributed``'s own helper uses
(``<group>`` / ``<group>/`` / ``cpu/`` for gloo, ``cuda/`` for NCCL), so SGLang's
``init_custom_process_group`` on the other side meets it.

:func:`form_group` is the slime order (contract §5.3): fire every engine's HTTP init call,
join as rank 0 in a thread, then collect the replies; any failure destroys the half-formed
group and raises :class:`~asyncrl.weight_sync.WeightSyncError`.

Not covered: the NCCL path was not run here (no GPU on the development machine).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from asyncrl.weight_sync import (
    DEFAULT_GROUP_NAME,
    WeightGroup,
    WeightSyncError,
    init_weight_group,
    is_loopback,
    reserve_listen_socket,
)

log = logging.getLogger(__name__)

REPLY_SLACK_S = 10.0  # an engine answers its init call just after the rendezvous completes


def init_group(master_address: str, master_port: int, world_size: int, *, backend: str, group_name: str,
               timeout_s: float, listen_socket: socket.socket | None) -> WeightGroup:
    """Host the group as rank 0 (blocking until every engine rank joined)."""
    bound = listen_socket.getsockname() if listen_socket is not None else (master_address, master_port)
    log.info("hosting weight group %r (%s, world size %d) on %s:%d", group_name, backend, world_size, bound[0] or "*", bound[1])
    if backend == "gloo":
        return init_weight_group(master_address, master_port, world_size, 0, group_name=group_name,
                                 timeout_s=timeout_s, listen_socket=listen_socket)
    if backend != "nccl":
        raise WeightSyncError(f"unknown weight-sync backend {backend!r}")
    limit = timedelta(seconds=timeout_s)
    keep: list = []
    try:
        fd = None
        if listen_socket is None and is_loopback(master_address):
            listen_socket = reserve_listen_socket(master_address, master_port)
        if listen_socket is not None:
            keep.append(listen_socket)
            fd = listen_socket.fileno()
        store = dist.TCPStore(master_address, master_port, world_size, True, limit,
                              wait_for_workers=False, multi_tenant=False, master_listen_fd=fd)
        if listen_socket is not None:  # the store owns the fd now (and closes it)
            keep.remove(listen_socket)
            listen_socket.detach()
        keep.append(store)
        prefixed = dist.PrefixStore("cuda/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = limit
        pg = dist.ProcessGroupNCCL(prefixed, 0, world_size, opts)
    except Exception as exc:
        for item in keep:
            if isinstance(item, socket.socket):
                item.close()
        raise WeightSyncError(f"forming NCCL weight group {group_name!r} via {master_address}:{master_port} failed: {exc}") from exc
    return WeightGroup(pg=pg, rank=0, world_size=world_size, group_name=group_name, timeout_s=timeout_s, _keep=keep)


async def form_group(engines: Sequence[Any], master_address: str, master_port: int, *, backend: str,
                     ranks_per_engine: int = 1, group_name: str = DEFAULT_GROUP_NAME, timeout_s: float) -> WeightGroup:
    """Form the group with ``engines`` (EngineClient-like), engine i at ranks ``1 + i * ranks_per_engine``."""
    world_size = 1 + ranks_per_engine * len(engines)
    sock = reserve_listen_socket(master_address, master_port)
    port = sock.getsockname()[1]
    tasks = [
        asyncio.create_task(e.init_weights_update_group(master_address, port, 1 + i * ranks_per_engine, world_size,
                                                        group_name, backend, timeout_s=timeout_s + REPLY_SLACK_S))
        for i, e in enumerate(engines)
    ]
    try:
        group = await asyncio.to_thread(init_group, master_address, port, world_size, backend=backend,
                                        group_name=group_name, timeout_s=timeout_s, listen_socket=sock)
    except BaseException:
        for t in tasks:
            t.cancel()
        sock.close()
        raise
    done, pending = await asyncio.wait(tasks, timeout=timeout_s + REPLY_SLACK_S)
    errors = [f"engine {i}: {'no answer' if t in pending else t.exception()}" for i, t in enumerate(tasks)
              if t in pending or t.exception() is not None]
    for t in pending:
        t.cancel()
    if errors:
        group.destroy()
        raise WeightSyncError("init_weights_update_group failed: " + "; ".join(errors))
    return group
