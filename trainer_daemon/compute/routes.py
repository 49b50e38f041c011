"""A micro-batch's routes for router replay (issue 53): each trajectory's routed experts
(:mod:`asyncrl.wire.routed_experts`, one row per position but the last) laid out in the order
the micro-batch's ``input_ids`` are flattened — rows of a padded batch one after another, or
the packed row — with ``-1`` where the router routes live: each sequence's last position (no
engine call put it through the model), padding (neither affects a scored token: the forward
is causal and padding comes after a sequence's tokens), and the wire's *no route* rows
(:func:`asyncrl.wire.routed_experts.no_route`). int16 (a step's micro-batches wait on the
device together: 2 bytes per id). None when no trajectory has routes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.wire import Trajectory
from asyncrl.wire.routed_experts import no_route


def micro_batch_routes(rows: Sequence[Trajectory], offsets: Sequence[int], tokens: int) -> torch.Tensor | None:
    """``[tokens, layers, top_k]`` (long) with trajectory ``r``'s rows from ``offsets[r]``."""
    routed = [t.routed_experts for t in rows if t.routed_experts is not None]
    if not routed:
        return None
    layers, top_k = routed[0].layers, routed[0].top_k
    out = torch.full((tokens, layers, top_k), -1, dtype=torch.int16)
    for t, start in zip(rows, offsets, strict=True):
        r = t.routed_experts
        if r is None:  # not trained with the others' routes: its rows route live (admission refuses it under R3)
            continue
        if (r.layers, r.top_k) != (layers, top_k):
            raise ValueError(f"trajectory {t.id}: routes of {r.layers} x {r.top_k}, the micro-batch's are {layers} x {top_k}")
        ids = torch.from_numpy(r.array())
        out[start:start + r.num_rows] = torch.where(ids == no_route(r.width), -1, ids).to(torch.int16)
    return out
