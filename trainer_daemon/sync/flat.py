"""Packing buckets into reused byte buffers with a one-bucket lookahead, and broadcasting them.

Measured on the development machine (bench/trainer.py, smollm2-135m, 538 MB in 3 buckets):
allocating a fresh 256 MiB buffer per bucket and sync cost ~0.57 s per sync — about as much
as the broadcast itself — mostly page faults. :class:`FlatBuffers` keeps one ``uint8`` buffer
per bucket for the trainer's lifetime (one extra host copy of the weights on rank 0), and
:func:`send_buckets` packs bucket ``i + 1`` in a thread while bucket ``i`` is on the wire and
the engines load it, so the copy mostly hides behind the engines' own work.

A bucket goes on the wire as the ``uint8`` view of its packed bytes (SGLang's
``flattened_bucket`` receiver allocates one byte buffer of the bucket's size): see
:mod:`asyncrl.weight_sync.buckets`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch

from asyncrl.weight_sync import Bucket, WeightGroup, pack_bucket


class FlatBuffers:
    """One reusable byte buffer per bucket index (reallocated only if the bucket's size changes)."""

    def __init__(self) -> None:
        self._bufs: dict[int, torch.Tensor] = {}

    def fill(self, index: int, bucket: Bucket, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        buf = self._bufs.get(index)
        if buf is None or buf.numel() != bucket.nbytes:
            buf = self._bufs[index] = torch.empty(bucket.nbytes, dtype=torch.uint8)
        return pack_bucket([weights[n] for n in bucket.names], out=buf)

    def drop(self) -> None:
        """Forget every buffer: after a cancelled gloo broadcast, gloo's thread may still read
        the old one until its own timeout, so the next sync must not write into it."""
        self._bufs.clear()


async def send_buckets(buckets: Sequence[Bucket], weights: Mapping[str, torch.Tensor], buffers: FlatBuffers,
                       send: Callable[[int, Bucket, torch.Tensor], Awaitable[None]]) -> None:
    """``send(i, bucket, flat)`` for every bucket in order, packing the next one meanwhile."""
    if not buckets:
        return
    nxt = asyncio.create_task(asyncio.to_thread(buffers.fill, 0, buckets[0], weights))
    try:
        for i, bucket in enumerate(buckets):
            flat = await nxt
            if i + 1 < len(buckets):
                nxt = asyncio.create_task(asyncio.to_thread(buffers.fill, i + 1, buckets[i + 1], weights))
            await send(i, bucket, flat)
    finally:
        if not nxt.done():
            await asyncio.gather(nxt, return_exceptions=True)  # a thread cannot be cancelled: let it finish


async def broadcast_flat(group: WeightGroup, flat: torch.Tensor, timeout_s: float, cancel: threading.Event) -> None:
    """Broadcast one packed bucket from rank 0 (moved to the group's device for NCCL)."""
    if group.backend == "nccl":
        flat = flat.to(group.device, non_blocking=True)
    await asyncio.to_thread(group.broadcast, flat, 0, timeout_s, cancel)
