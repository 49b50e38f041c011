"""Outcome advantages (GRPO, Dr. GRPO, RLOO) and zero-variance group detection.

Each trajectory ``i`` has one scalar reward ``r_i`` and a group id ``g(i)`` (all trajectories
generated for one prompt share it). For a group ``G`` of size ``n >= 2``:

    mean_G = (1/n) sum_{j in G} r_j
    std_G  = sqrt( (1/(n-1)) sum_{j in G} (r_j - mean_G)^2 )        (unbiased, torch.std)
    A_i    = (r_i - mean_G) / (std_G + epsilon)    if norm_by_std   (GRPO)
    A_i    =  r_i - mean_G                         otherwise        (Dr. GRPO)

RLOO (``actor.adv_estimator="rloo"``; Kool et al. 2019, Ahmadian et al. 2024): each
trajectory's baseline is the mean of the *other* members of its group,

    A_i    = r_i - (1/(n-1)) sum_{j in G, j != i} r_j  =  n/(n-1) (r_i - mean_G)

(unbiased: the baseline does not depend on the trajectory's own sample; no std normalisation).

Every response token ``t`` of trajectory ``i`` gets ``A[i, t] = A_i * response_mask[i, t]``.

Conventions (knobs: ``actor.norm_adv_by_std_in_grpo``, ``actor.filter_zero_variance_groups``):

- A group of size 1 gets advantage 0 (it has no baseline). verl instead uses mean 0, std 1
  there, i.e. ``A = r``; asyncrl deliberately differs.
- A group whose rewards are all exactly equal gets advantage exactly 0 (no learning signal),
  independent of floating-point rounding in the mean.
- ``epsilon`` defaults to verl's ``1e-6``.

Computation is in float64 and returned in ``response_mask``'s float dtype (float32 for an
integer/bool mask). No gradient flows (advantages are constants of the loss).

Not covered: process (per-token) rewards, GAE/critic baselines, pass@k variants.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

DEFAULT_EPSILON = 1e-6


def group_index(group_ids: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to contiguous ints ``0..K-1`` in order of first appearance.

    Returns ``(index, K)`` with ``index`` a ``(B,)`` int64 tensor.
    """
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    table: dict[Hashable, int] = {}
    out = [table.setdefault(g, len(table)) for g in ids]
    return torch.tensor(out, dtype=torch.int64), len(table)


def _group_stats(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor):
    r = rewards.detach().to(torch.float64).reshape(-1)
    idx, k = group_index(group_ids)
    if idx.numel() != r.numel():
        raise ValueError(f"{r.numel()} rewards but {idx.numel()} group ids")
    idx = idx.to(r.device)
    count = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(
        0, idx, torch.ones_like(r)
    )
    mean = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(0, idx, r) / count
    sq = torch.zeros(k, dtype=torch.float64, device=r.device).index_add_(
        0, idx, (r - mean[idx]) ** 2
    )
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    rmax = torch.full((k,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce_(
        0, idx, r, "amax"
    )
    rmin = torch.full((k,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce_(
        0, idx, r, "amin"
    )
    return r, idx, count, mean, std, rmax == rmin


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    epsilon: float = DEFAULT_EPSILON,
) -> torch.Tensor:
    """Per-trajectory GRPO advantages ``A_i`` (see module doc); ``rewards`` ``(B,)`` -> ``(B,)`` float64."""
    r, idx, count, mean, std, constant = _group_stats(rewards, group_ids)
    adv = r - mean[idx]
    if norm_by_std:
        adv = adv / (std[idx] + epsilon)
    zero = (count[idx] < 2) | constant[idx]
    return torch.where(zero, torch.zeros_like(adv), adv)


def rloo_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """Per-trajectory RLOO advantages (module doc); ``(B,)`` -> ``(B,)`` float64. Groups of
    size 1 and constant groups get 0, as in GRPO."""
    r, idx, count, mean, _std, constant = _group_stats(rewards, group_ids)
    n = count[idx]
    adv = (r - mean[idx]) * n / (n - 1).clamp(min=1.0)
    zero = (n < 2) | constant[idx]
    return torch.where(zero, torch.zeros_like(adv), adv)


def outcome_advantages(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor, estimator: str = "grpo",
                       *, norm_by_std: bool = True, epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """``actor.adv_estimator``'s per-trajectory advantages (``grpo`` honours ``norm_by_std``)."""
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids)
    if estimator == "grpo":
        return grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std, epsilon=epsilon)
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def grpo_token_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    epsilon: float = DEFAULT_EPSILON,
) -> torch.Tensor:
    """GRPO advantages broadcast to tokens: ``A[i, t] = A_i * response_mask[i, t]``, shape ``(B, T)``."""
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.numel():
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must be (B={rewards.numel()}, T)"
        )
    adv = grpo_advantages(rewards, group_ids, norm_by_std=norm_by_std, epsilon=epsilon)
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    adv = adv.to(response_mask.device).unsqueeze(-1) * response_mask.to(torch.float64)
    return adv.to(dtype)


def zero_variance_mask(
    rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor
) -> torch.Tensor:
    """``(B,)`` bool: True for trajectories whose group's rewards are all equal (incl. size-1 groups).

    With ``filter_zero_variance_groups`` the trainer drops these trajectories (DAPO's dynamic
    sampling filter); their advantages are 0 anyway, so dropping them changes only the loss
    normalisers (token / sequence counts) and saves compute.
    """
    _, idx, _, _, _, constant = _group_stats(rewards, group_ids)
    return constant[idx]


def zero_variance_groups(
    rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor
) -> list[Hashable]:
    """The group ids (in order of first appearance) whose rewards are all equal."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    flags = zero_variance_mask(rewards, group_ids).tolist()
    seen: dict[Hashable, None] = {}
    for g, f in zip(ids, flags, strict=True):
        if f:
            seen.setdefault(g, None)
    return list(seen)
