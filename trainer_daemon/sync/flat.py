"""Sending buckets as flattened broadcasts with reused host buffers and a one-bucket lookahead.

Measured on the development machine (bench/trainer.py, smollm2-135m, 538 MB in 3 buckets):
``torch.cat`` into a fresh 256 MiB buffer per bucket and sync cost ~0.57 s per sync — about
as much as the broadcast itself — mostly page faults. :class:`FlatBuffers` keeps one buffer
per bucket for the trainer's lifetime (one extra host copy of the weights on rank 0), and
:func:`send_buckets` fills bucket ``i + 1`` in a thread while bucket ``i`` is on the wire and
the engines apply it, so the copy mostly hides behind the engines' own work.

:func:`push_flat_bucket` is slime's order for one bucket (contract §5.3): fire each engine's
``/update_weights_from_distributed`` (``load_format=flattened_bucket``), broadcast, collect the
replies; like ``asyncrl.weight_sync.engines.push_bucket`` but on an already flat tensor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from asyncrl.weight_sync import Bucket, WeightGroup, WeightSyncError

REPLY_GRACE_S = 30.0  # after a failed broadcast, wait this long for the engines' answers (to report them)
REPLY_SLACK_S = 10.0  # an engine answers just after its side of the broadcast and the apply


class FlatBuffers:
    """One reusable flat host buffer per bucket index (reallocated only if the bucket changes)."""

    def __init__(self) -> None:
        self._bufs: dict[int, torch.Tensor] = {}

    def fill(self, index: int, bucket: Bucket, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        buf = self._bufs.get(index)
        if buf is None or buf.numel() != bucket.numel or buf.dtype != bucket.dtype:
            buf = self._bufs[index] = torch.empty(bucket.numel, dtype=bucket.dtype)
        torch.cat([weights[n].detach().reshape(-1) for n in bucket.names], out=buf)
        return buf


async def send_buckets(buckets: Sequence[Bucket], weights: Mapping[str, torch.Tensor], buffers: FlatBuffers,
                       send: Callable[[int, Bucket, torch.Tensor], Awaitable[None]]) -> None:
    """``send(i, bucket, flat)`` for every bucket in order, filling the next one meanwhile."""
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


async def _collect(tasks: Sequence[asyncio.Task], timeout_s: float) -> list[str]:
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    return [f"engine {i}: {'no answer' if t in pending else t.exception()}" for i, t in enumerate(tasks)
            if t in pending or t.exception() is not None]


async def push_flat_bucket(group: WeightGroup, engines: Sequence[Any], bucket: Bucket, flat: torch.Tensor, *,
                           weight_version: str | None, timeout_s: float) -> float:
    """HTTP calls first, then the broadcast, then the replies; WeightSyncError names failed
    engines. Returns the seconds spent in the collective itself."""
    tasks = [asyncio.create_task(e.update_weights_from_distributed(
        **bucket.http_fields(), group_name=group.group_name, weight_version=weight_version,
        load_format="flattened_bucket", flush_cache=False, timeout_s=timeout_s + REPLY_SLACK_S)) for e in engines]
    await asyncio.sleep(0)  # let the requests leave before the broadcast thread takes a core
    t0 = time.perf_counter()
    try:
        await asyncio.to_thread(group.broadcast, flat, 0, timeout_s)
    except WeightSyncError as exc:
        errors = await _collect(tasks, REPLY_GRACE_S)
        raise WeightSyncError(f"{exc}; engine replies: {'; '.join(errors) or 'ok'}") from exc
    collective = time.perf_counter() - t0
    errors = await _collect(tasks, timeout_s + REPLY_SLACK_S)
    if errors:
        raise WeightSyncError("update_weights_from_distributed failed: " + "; ".join(errors))
    return collective
