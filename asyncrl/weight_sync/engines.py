"""Sender-side protocol with engines over HTTP (slime's order, contract §5.3).

- :func:`form_group_with_engines`: the engines' ``/init_weights_update_group`` calls block
  until the rendezvous completes, so they are fired first, then the sender joins as
  rank 0 (in a thread), then the HTTP replies are collected.
- :func:`push_bucket`: the ``/update_weights_from_distributed`` calls are fired *before*
  the broadcast (awaiting them first would deadlock: engines answer only after the
  broadcast), the bucket is broadcast, then the replies are collected. Any engine
  failure raises :class:`~asyncrl.weight_sync.group.WeightSyncError` naming the engines.
- :func:`push_weights`: every bucket of ``plan_buckets`` in order, the version sent with
  each call (SGLang sets the version per successful call).

Pause / flush / continue around a push is the caller's job (the sync agent), in a
``try/finally`` so engines are never left paused. ``engines`` are
:class:`~asyncrl.engine_client.EngineClient` objects (anything with the same methods).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asyncrl.weight_sync.buckets import Bucket, plan_buckets
from asyncrl.weight_sync.group import (
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    WeightGroup,
    WeightSyncError,
    init_weight_group,
    reserve_listen_socket,
)
from asyncrl.weight_sync.transfer import broadcast_bucket

# After a failed broadcast the engines' HTTP calls end on their own timeouts; wait this
# long for their answers (to report them) before giving up on them.
REPLY_GRACE_S = 30.0


async def _collect(tasks: Sequence[asyncio.Task], what: str, grace_s: float | None = None) -> list[Any]:
    done, pending = await asyncio.wait(tasks, timeout=grace_s) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    errors = []
    for i, t in enumerate(tasks):
        if t in pending:
            errors.append(f"engine {i}: no answer")
        elif t.exception() is not None:
            errors.append(f"engine {i}: {t.exception()}")
    if errors:
        raise WeightSyncError(f"{what} failed: " + "; ".join(errors))
    return [t.result() for t in tasks]


async def form_group_with_engines(
    engines: Sequence[Any],
    master_address: str = "127.0.0.1",
    master_port: int = 0,
    *,
    ranks_per_engine: Sequence[int] | None = None,
    group_name: str = DEFAULT_GROUP_NAME,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> WeightGroup:
    """Form the group with rank 0 here and engine *i* at ``1 + sum(ranks[:i])``."""
    ranks = list(ranks_per_engine or [1] * len(engines))
    world_size = 1 + sum(ranks)
    sock = reserve_listen_socket(master_address, master_port)
    port = sock.getsockname()[1]
    offsets = [1 + sum(ranks[:i]) for i in range(len(engines))]
    tasks = [
        asyncio.create_task(e.init_weights_update_group(master_address, port, off, world_size, group_name, "gloo", timeout_s=timeout_s + 10))
        for e, off in zip(engines, offsets, strict=True)
    ]
    try:
        group = await asyncio.to_thread(
            init_weight_group, master_address, port, world_size, 0, group_name=group_name, timeout_s=timeout_s, listen_socket=sock,
        )
    except BaseException:
        for t in tasks:
            t.cancel()
        sock.close()
        raise
    try:
        await _collect(tasks, f"init_weights_update_group({group_name})", timeout_s + 10)
    except BaseException:
        group.destroy()
        raise
    return group


async def push_bucket(
    group: WeightGroup,
    engines: Sequence[Any],
    bucket: Bucket,
    tensors: Sequence[torch.Tensor],
    *,
    weight_version: str | None = None,
    flattened: bool = True,
    timeout_s: float | None = None,
) -> None:
    """Send one bucket to every engine (HTTP first, then broadcast, then replies)."""
    limit = group.timeout_s if timeout_s is None else timeout_s
    tasks = [
        asyncio.create_task(
            e.update_weights_from_distributed(
                **bucket.http_fields(), group_name=group.group_name, weight_version=weight_version,
                load_format="flattened_bucket" if flattened else None, flush_cache=False, timeout_s=limit + 10,
            )
        )
        for e in engines
    ]
    await asyncio.sleep(0)  # let the requests start before the broadcast thread takes a core
    try:
        await asyncio.to_thread(broadcast_bucket, group, tensors, flattened, limit)
    except WeightSyncError as exc:
        try:
            await _collect(tasks, "update_weights_from_distributed", REPLY_GRACE_S)
        except WeightSyncError as replies:
            raise WeightSyncError(f"{exc}; engine replies: {replies}") from exc
        raise
    await _collect(tasks, "update_weights_from_distributed", limit + 10)


async def push_weights(
    group: WeightGroup,
    engines: Sequence[Any],
    named_tensors: Mapping[str, torch.Tensor],
    *,
    bucket_bytes: int,
    weight_version: str | None = None,
    flattened: bool = True,
    timeout_s: float | None = None,
) -> int:
    """Push every tensor, bucket by bucket in order; returns the number of buckets."""
    buckets = plan_buckets(named_tensors, bucket_bytes)
    for bucket in buckets:
        tensors = [named_tensors[n] for n in bucket.names]
        await push_bucket(group, engines, bucket, tensors, weight_version=weight_version, flattened=flattened, timeout_s=timeout_s)
    return len(buckets)
