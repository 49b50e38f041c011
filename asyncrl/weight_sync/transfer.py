"""Moving one bucket through a formed :class:`~asyncrl.weight_sync.group.WeightGroup`.

Sender and receiver must agree on the bucket (names order, dtypes, shapes) and on
``flattened``: one broadcast of the concatenated bucket (SGLang's ``flattened_bucket``)
or one broadcast per tensor in ``names`` order. Both calls block until the broadcasts
finish (or raise :class:`~asyncrl.weight_sync.group.WeightSyncError` on failure/timeout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from asyncrl.weight_sync.buckets import flatten_bucket, unflatten_bucket
from asyncrl.weight_sync.group import WeightGroup


def broadcast_bucket(
    group: WeightGroup,
    tensors: Sequence[torch.Tensor],
    flattened: bool = True,
    timeout_s: float | None = None,
) -> None:
    """Sender side (rank 0): broadcast ``tensors`` (one bucket, in names order)."""
    if flattened:
        group.broadcast(flatten_bucket(tensors), src=0, timeout_s=timeout_s)
        return
    for t in tensors:
        group.broadcast(t.detach().contiguous(), src=0, timeout_s=timeout_s)


def receive_bucket(
    group: WeightGroup,
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    flattened: bool = True,
    timeout_s: float | None = None,
) -> list[torch.Tensor]:
    """Receiver side: fresh CPU tensors filled by the sender's broadcast of one bucket."""
    if flattened:
        if len(set(dtypes)) > 1:
            raise ValueError("a flattened bucket needs one dtype")
        flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=dtypes[0])
        group.broadcast(flat, src=0, timeout_s=timeout_s)
        return unflatten_bucket(flat, shapes)
    out = [torch.empty(list(s), dtype=d) for d, s in zip(dtypes, shapes, strict=True)]
    for t in out:
        group.broadcast(t, src=0, timeout_s=timeout_s)
    return out
