"""The trainer's own process group: init/teardown, device, and the few collectives the daemon
needs outside FSDP (broadcast of rank 0's commands, small metric reductions).

Contract:

- ``init_distributed(trainer_cfg)`` joins the torchrun world (``RANK``/``WORLD_SIZE`` in the
  environment) or, without torchrun, forms a one-rank world on a loopback ``TCPStore`` (tests,
  benchmarks, ``python -m trainer_daemon`` on a laptop).
- ``device="cpu"``: backend gloo, fp32 unless ``mixed_precision=bf16``. ``device="cuda"``: NCCL
  for the default group (FSDP) plus a gloo ``cpu_group`` for host-side messages. The same code
  path otherwise.
- Interfaces (issue 48): ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``, where unset, name the
  interface this node reaches ``MASTER_ADDR`` through (``lo`` for a loopback master;
  :func:`asyncrl.listen.socket_ifname_env`), so gloo's and NCCL's own sockets listen there and
  not on a public interface (torchrun's store is the launcher's business, see
  ``trainer_daemon.torchrun``; the weight group's is :mod:`asyncrl.weight_sync`'s).
- Every collective has a timeout: ``PROCESS_GROUP_TIMEOUT_S``.
- Host messages travel as msgpack bytes in a uint8 tensor, never pickled.

Not covered: NCCL was not run here (no GPU on the development machine); nothing else differs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.listen import reserve_listen_socket, socket_ifname_env

log = logging.getLogger(__name__)

# Bounds every collective of the trainer's world. Rank-0-only work between collectives
# (an HF export of a few GB, finalising a checkpoint) must fit in it; a dead peer surfaces
# as an error after it instead of a hang.
PROCESS_GROUP_TIMEOUT_S = 600.0


@dataclass
class DistContext:
    """Rank facts and the groups of this trainer process."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    cpu_group: dist.ProcessGroup | None = None
    _ckpt_group: dist.ProcessGroup | None = field(default=None, repr=False)
    _keep: list = field(default_factory=list, repr=False)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def checkpoint_group(self) -> dist.ProcessGroup:
        """A dedicated gloo group for ``dcp.async_save`` (created on first use, on every rank)."""
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
        return self._ckpt_group

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None)."""
        size = torch.tensor([len(data) if self.is_rank0 and data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        if self.is_rank0 and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if buf.numel():
            dist.broadcast(buf, src=0, group=self.cpu_group)
        return buf.numpy().tobytes()

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def destroy(self, meet_first: bool = True) -> None:
        """Destroy every group (idempotent). With ``meet_first`` and more than one rank, the
        ranks first meet at a gloo barrier bounded by ``DESTROY_BARRIER_S``: a rank tearing
        down its gloo pairs while a peer is still in its last collective made the peer abort
        ("terminate called without an active exception", seen under load). A peer that
        never comes (it died) costs that bound, then the teardown goes on."""
        if dist.is_initialized() and meet_first and self.world_size > 1:
            try:
                dist.monitored_barrier(group=self.cpu_group, timeout=timedelta(seconds=DESTROY_BARRIER_S))
            except Exception as exc:  # noqa: BLE001 - a peer is gone: tear down anyway
                log.warning("ranks did not meet before teardown: %s", exc)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a peer died: nothing left to tear down cleanly
                log.warning("destroying the process group failed: %s", exc)
        for item in self._keep:
            close = getattr(item, "close", None)
            if close is not None:
                close()
        self._keep.clear()


DESTROY_BARRIER_S = 10.0  # how long a rank waits for its peers before tearing the groups down


def init_distributed(device: str = "cpu", timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> DistContext:
    """Join the torchrun world (or form a one-rank loopback world); see the module doc."""
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    keep: list = []
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # gloo's and NCCL's listening sockets on the interface toward the master, never every one
        os.environ.update(socket_ifname_env(os.environ.get("MASTER_ADDR", ""), os.environ))
        dist.init_process_group(backend=backend, timeout=timeout, device_id=dev if device == "cuda" else None)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        sock = reserve_listen_socket("127.0.0.1", 0)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], 1, True, timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
        sock.detach()  # the store owns the fd now (and closes it)
        keep.append(store)
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    cpu_group = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    ctx = DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                      device=dev, backend=backend, cpu_group=cpu_group, _keep=keep)
    log.info("rank %d/%d on %s (%s)", ctx.rank, ctx.world_size, dev, backend)
    return ctx
