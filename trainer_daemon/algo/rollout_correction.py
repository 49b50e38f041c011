"""Off-policy corrections between the rollout engine's policy and the trainer's: importance
weights, truncated (TIS) or masked (MIS, IcePop), at token or sequence level.

Per token ``t`` of sequence ``i`` with mask ``m``, ``old`` the trainer-side anchor log-prob and
``behav`` the rollout engine's (``policy_loss.resolve_log_probs``):

    d_t    = clamp(old_t - behav_t, -20, 20)                   (log importance ratio)
    token:     rho_t = exp(d_t)
    sequence:  rho_t = exp( sum_s m_s d_s )                    (every token of i)
    geometric: rho_t = exp( sum_s m_s d_s / sum_s m_s )        (masking only)

The IS weight uses ``actor.rollout_is_level`` (token | sequence): ``w = min(rho, cap)`` with
``cap = actor.tis_imp_ratio_cap`` (None: no truncation, ``w = rho``). Rejection
(``actor.rollout_rs``: token | sequence | geometric) keeps a token when its ``rho`` at that
level lies in ``[rollout_rs_threshold_lower, rollout_rs_threshold]`` (lower default
``1 / threshold``) and gives it weight 0 otherwise:

- TIS (Yao et al. 2025): ``rollout_rs=None``, a cap: ``w = min(rho, cap)``;
- MIS, masked IS: ``rollout_rs`` at the IS level, no cap: ``w = rho`` inside the bounds, 0 outside;
- IcePop (two-sided token masking, the Ring-1T report 2025): ``rollout_rs="token"`` with both
  bounds (e.g. 0.5 and 2), no cap.

A masked token contributes nothing to the gradient but still counts in the loss normaliser:
the batch's token and sequence counts are fixed before the loss, so masking cannot raise the
weight of the tokens that survive. The weight is detached (a constant of the loss).

Metrics (local masked means over real tokens): ``actor/is_weight_mean|max`` (of the weights
applied), ``actor/is_truncated_frac`` (``rho > cap``), ``actor/rs_masked_frac`` (tokens given 0
by rejection), ``actor/behav_kl`` (``mean(behav - old)``, the k1 estimate of KL(pi_behav||pi_old)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer_daemon.algo.aggregation import masked_mean

if TYPE_CHECKING:
    from asyncrl.config.sections_infra import ActorConfig

LOG_RATIO_BOUND = 20.0


def active(config: ActorConfig) -> bool:
    """Whether any correction is configured (else the rollout log-probs are unused)."""
    return config.tis_imp_ratio_cap is not None or config.rollout_rs is not None


def level_log_ratio(d: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log rho`` per token at ``level`` (module doc); ``d`` and ``mask`` are ``(B, T)``."""
    m = mask.to(d.dtype)
    if level == "token":
        return d
    total = (d * m).sum(-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(d)
    if level == "geometric":
        return (total / m.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(d)
    raise ValueError(f"unknown level {level!r}")


def correction_weights(old: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor,
                       config: ActorConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(w, stats)``: the detached ``(B, T)`` weight of the module doc, and its diagnostics as
    0-dim float64 tensors."""
    d = torch.clamp(old.detach().double() - behav.detach().double(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    m = mask.bool()
    rho = level_log_ratio(d, m, config.rollout_is_level).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    cap = config.tis_imp_ratio_cap
    w = rho if cap is None else rho.clamp(max=cap)
    stats = {"actor/is_truncated_frac": masked_mean((rho > cap).double() if cap is not None else torch.zeros_like(rho), m)}
    if config.rollout_rs is not None:
        upper = config.rollout_rs_threshold
        lower = config.rollout_rs_threshold_lower if config.rollout_rs_threshold_lower is not None else 1.0 / upper
        rs = level_log_ratio(d, m, config.rollout_rs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        keep = (rs >= lower) & (rs <= upper)
        w = torch.where(keep, w, torch.zeros_like(w))
        stats["actor/rs_masked_frac"] = masked_mean((~keep).double(), m)
    stats["actor/is_weight_mean"] = masked_mean(w, m)
    stats["actor/is_weight_max"] = torch.where(m.any(), torch.where(m, w, torch.zeros_like(w)).amax(), torch.zeros((), dtype=w.dtype, device=w.device))
    stats["actor/behav_kl"] = masked_mean(-d, m)
    return w.to(old.dtype), stats
