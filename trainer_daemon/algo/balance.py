"""Data-parallel batch balancing: assign a mini-batch's trajectories to ranks and micro-batches.

Constraint that drives the design: under FSDP every forward/backward issues collectives
(all-gather / reduce-scatter), so **every rank must run the same number of micro-batches** or
the job hangs. Token balance across ranks then keeps the slowest rank (the step time) short.

Decisions:

1. Whole groups stay on one rank (``keep_groups=True``, default). This is not needed for the
   math (advantages are computed over the whole mini-batch before splitting, and the loss uses
   global normalisers), but it keeps a prompt's trajectories together for shared-prefix reuse
   and makes per-rank group statistics meaningful. ``keep_groups=False`` balances single
   trajectories instead (equal counts whenever the total is divisible by ``world_size``).
2. Each rank's capacity is ``ceil(N / world_size)`` trajectories. Groups (or trajectories) are
   taken in decreasing token weight (ties: first index) and each goes to the least-loaded rank
   that still has room (ties: fewer trajectories, then lower rank); if none has room it goes to
   the rank with the fewest trajectories. With equal group sizes and a group count divisible by
   ``world_size`` every rank gets exactly ``N / world_size`` trajectories; with plain greedy
   LPT the token imbalance ``max - min`` is at most the largest item's weight in the
   unconstrained case, and the tests check that bound under equal-size groups.
3. Micro-batches: every rank uses ``M = max_r ceil(n_r / micro_batch_size)`` micro-batches of
   at most ``micro_batch_size`` trajectories, filled by the same greedy rule (token-balanced).
   When ranks hold unequal counts a rank may get fewer than ``M`` non-empty micro-batches; its
   remaining ones are **empty lists** and the trainer must still run a forward/backward for each
   (e.g. one padding token with a zero loss mask, loss multiplied by 0) so the collective
   counts match. Equal counts (decision 2) avoid this.

``seq_lens`` are the tokens a forward pass processes per trajectory (prompt + response). Results
are lists of indices into the input, sorted ascending inside each micro-batch / rank; the
output is a pure function of the input (deterministic).

4. Token budget instead (``actor.use_dynamic_bsz``, verl's): each rank's trajectories go into
   micro-batches of at most ``actor.ppo_max_token_len_per_gpu`` tokens, first fit, longest
   first; ranks needing fewer micro-batches than the most get empty ones (the padding rule of 3).

Not covered: sequence parallelism, and balancing the attention cost (quadratic in length)
instead of token counts.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence


def _greedy(weights: Sequence[int], counts: Sequence[int], bins: int, cap: int) -> list[list[int]]:
    """Assign items (weight, count) to ``bins`` bins: heaviest first to the least-loaded bin with room."""
    load = [0] * bins
    size = [0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        fits = [b for b in range(bins) if size[b] + counts[item] <= cap]
        if fits:
            b = min(fits, key=lambda b: (load[b], size[b], b))
        else:
            b = min(range(bins), key=lambda b: (size[b], load[b], b))
        out[b].append(item)
        load[b] += weights[item]
        size[b] += counts[item]
    return out


def balance_across_ranks(
    seq_lens: Sequence[int],
    group_ids: Sequence[Hashable],
    world_size: int,
    *,
    keep_groups: bool = True,
) -> list[list[int]]:
    """Trajectory indices per rank (``world_size`` lists), token-balanced; see module doc."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(seq_lens) != len(group_ids):
        raise ValueError(f"{len(seq_lens)} lengths but {len(group_ids)} group ids")
    if keep_groups:
        members: dict[Hashable, list[int]] = {}
        for i, g in enumerate(group_ids):
            members.setdefault(g, []).append(i)
        items = list(members.values())
    else:
        items = [[i] for i in range(len(seq_lens))]
    weights = [sum(int(seq_lens[i]) for i in it) for it in items]
    counts = [len(it) for it in items]
    cap = math.ceil(len(seq_lens) / world_size)
    bins = _greedy(weights, counts, world_size, cap)
    return [sorted(i for item in b for i in items[item]) for b in bins]


def split_micro_batches(
    seq_lens: Sequence[int],
    indices: Sequence[int],
    micro_batch_size: int,
    num_micro_batches: int | None = None,
) -> list[list[int]]:
    """Split ``indices`` (one rank's trajectories) into token-balanced micro-batches.

    Uses ``max(ceil(len(indices) / micro_batch_size), num_micro_batches or 0)`` micro-batches of
    at most ``micro_batch_size`` each; pass the cross-rank maximum as ``num_micro_batches``.
    Micro-batches beyond ``len(indices)`` are empty (see the padding rule in the module doc).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    idx = list(indices)
    n = max(math.ceil(len(idx) / micro_batch_size), num_micro_batches or 0)
    if n == 0:
        return []
    bins = _greedy([int(seq_lens[i]) for i in idx], [1] * len(idx), n, micro_batch_size)
    return [sorted(idx[j] for j in b) for b in bins]


def split_by_tokens(seq_lens: Sequence[int], indices: Sequence[int], token_budget: int) -> list[list[int]]:
    """``indices`` (one rank's trajectories) into micro-batches of at most ``token_budget``
    tokens each (verl's ``use_dynamic_bsz``): first fit, longest first (ties: first index).
    Raises ValueError for a trajectory longer than the budget (it fits no micro-batch)."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    bins: list[list[int]] = []
    load: list[int] = []
    for i in sorted(indices, key=lambda i: (-int(seq_lens[i]), i)):
        n = int(seq_lens[i])
        if n > token_budget:
            raise ValueError(f"a trajectory of {n} tokens exceeds the micro-batch token budget of {token_budget}")
        b = next((k for k in range(len(bins)) if load[k] + n <= token_budget), None)
        if b is None:
            bins.append([])
            load.append(0)
            b = len(bins) - 1
        bins[b].append(i)
        load[b] += n
    return [sorted(b) for b in bins]


def plan_mini_batch(
    seq_lens: Sequence[int],
    group_ids: Sequence[Hashable],
    world_size: int,
    micro_batch_size: int,
    *,
    keep_groups: bool = True,
    token_budget: int | None = None,
) -> list[list[list[int]]]:
    """``plan[rank][micro] -> indices``: ranks balanced, every rank with the same number of
    micro-batches. With ``token_budget`` the micro-batches hold up to that many tokens
    (:func:`split_by_tokens`; ``micro_batch_size`` is then unused) and a rank that needs fewer
    than the most gets empty ones (dummies)."""
    ranks = balance_across_ranks(seq_lens, group_ids, world_size, keep_groups=keep_groups)
    if token_budget is not None:
        per_rank = [split_by_tokens(seq_lens, r, token_budget) for r in ranks]
        n_micro = max(len(p) for p in per_rank)
        return [p + [[] for _ in range(n_micro - len(p))] for p in per_rank]
    n_micro = max(math.ceil(len(r) / micro_batch_size) for r in ranks)
    return [split_micro_batches(seq_lens, r, micro_batch_size, n_micro) for r in ranks]
