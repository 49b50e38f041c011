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

A publish is handed host tensors by name (``sync.staging = state_dict``: planned and packed
here), :class:`~trainer_daemon.sync.staging.StagedWeights` (``buckets``: already packed on the
group's device at the sync point) or a :class:`~trainer_daemon.sync.streaming.BucketStream`
(``two_buckets``: packed by the training thread into two slots while they are sent, each slot
released once its broadcast is complete); :func:`plan_for`, :func:`weights_nbytes`,
:func:`send_buckets` and :func:`discard` take all three, so the publishers have one sequence.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import torch

from asyncrl.sync_control.errors import WeightSyncError
from asyncrl.weight_sync import Bucket, WeightGroup, pack_bucket, plan_buckets
from trainer_daemon.sync.staging import StagedWeights
from trainer_daemon.sync.streaming import BucketStream

Weights = Mapping[str, torch.Tensor] | StagedWeights | BucketStream
PACKED = (StagedWeights, BucketStream)


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


def plan_for(weights: Weights, bucket_bytes: int, first_tiny: bool) -> list[Bucket]:
    """The buckets of a publish: the staged plan, or ``plan_buckets`` of the host tensors."""
    if isinstance(weights, PACKED):
        return list(weights.buckets)
    return plan_buckets(weights, bucket_bytes, first_tiny=first_tiny)


def discard(weights: Weights) -> None:
    """A publish of ``weights`` failed: packed buffers an aborted collective may still read are
    not written again (host tensors need nothing)."""
    if isinstance(weights, PACKED):
        weights.discard()


def weights_nbytes(weights: Weights) -> int:
    if isinstance(weights, PACKED):
        return weights.nbytes
    return sum(t.numel() * t.element_size() for t in weights.values())


async def send_buckets(buckets: Sequence[Bucket], weights: Weights, buffers: FlatBuffers,
                       send: Callable[[int, Bucket, torch.Tensor], Awaitable[None]]) -> None:
    """``send(i, bucket, flat)`` for every bucket in order: staged buffers as they are, a
    stream's buckets as the training thread hands them over, host tensors packed one bucket
    ahead (module docstring)."""
    if isinstance(weights, BucketStream):
        try:
            for i, bucket in enumerate(buckets):
                await send(i, bucket, await weights.get(i))
                weights.release(i)  # the broadcast is complete: the producer may reuse its slot
        except BaseException:
            weights.discard()
            raise
        return
    if not buckets:
        return
    if isinstance(weights, StagedWeights):
        for i, bucket in enumerate(buckets):
            await send(i, bucket, weights.flats[i])
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


def _broadcast_on_side_stream(group: WeightGroup, flat: torch.Tensor, timeout_s: float, cancel: threading.Event) -> None:
    # NCCL orders its collective after the calling thread's current stream. The default
    # stream carries the next training step's kernels: waiting for those would delay the
    # engines' pause window by a micro-batch. A stream of our own holds only this copy.
    # An NCCL work's future completes once the collective is queued, not done: the end is
    # awaited on an event, bounded by the same timeout and cancellation.
    stream = torch.cuda.Stream(group.device)
    start = time.monotonic()
    with torch.cuda.stream(stream):
        if flat.device != group.device:
            flat = flat.to(group.device, non_blocking=True)
        group.broadcast(flat, 0, timeout_s, cancel)
        done = torch.cuda.Event()
        done.record(stream)
    while not done.query():
        if cancel.is_set() or time.monotonic() - start > timeout_s:
            why = "cancelled" if cancel.is_set() else f"timed out after {timeout_s:g} s"
            group.abort(why)
            raise WeightSyncError(f"broadcast in group {group.group_name!r} {why}")
        time.sleep(0.001)


async def broadcast_flat(group: WeightGroup, flat: torch.Tensor, timeout_s: float, cancel: threading.Event) -> None:
    """Broadcast one packed bucket from rank 0 (NCCL: on a side stream, moved to the group's
    device if it is not there; staged buckets already are)."""
    if group.backend == "nccl":
        await asyncio.to_thread(_broadcast_on_side_stream, group, flat, timeout_s, cancel)
        return
    await asyncio.to_thread(group.broadcast, flat, 0, timeout_s, cancel)
