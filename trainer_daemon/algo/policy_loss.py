"""The policy loss: PPO clip (asymmetric, dual clip), GSPO or CISPO (``actor.loss_mode``), times
the off-policy correction weight of :mod:`.rollout_correction`.

``vanilla`` (default). Per token, with ``logp`` the current policy's log-prob (gradient flows
here), ``old`` the *anchor* log-prob (``pi_old``; ``pi_prox`` in decoupled PPO), ``A`` the advantage:

    r      = exp(clamp(logp - old, -20, 20))
    l_1    = -A * r
    l_2    = -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
    l_clip = max(l_1, l_2)
    l      = min(l_clip, -A * clip_ratio_c)  if A < 0 and clip_ratio_c is not None   (dual clip)
           = l_clip                          otherwise

``gspo`` (Zheng et al. 2025, Group Sequence Policy Optimization): one ratio per sequence, the
geometric mean of its token ratios, clipped as a whole (no dual clip):

    s_i    = exp( sum_t m_t (logp_t - old_t) / sum_t m_t )
    s_i,t  = exp( sg(log s_i) + logp_t - sg(logp_t) )        (value s_i; gradient s_i * grad logp_t)
    l_t    = max(-A * s_i,t, -A * clamp(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high))

GSPO's clip ranges are ~1e3 times smaller than PPO's (its paper: 3e-4 and 4e-4) and it
aggregates with ``seq-mean-token-mean``; set both (docs/algorithms.md).

``cispo`` (MiniMax-M1, 2025): the importance ratio is clipped and treated as a constant, the
gradient flows through ``logp`` alone, so no token's gradient is ever dropped by the clip:

    l_t = -sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * logp_t

In every mode, when a behaviour log-prob ``behav`` (the rollout engine's) is given and a
correction is configured, ``l <- w * l`` with ``w`` from :func:`.rollout_correction.correction_weights`
(TIS, MIS, IcePop; token or sequence level).

The knobs are read from the run config's sections themselves, not from a copy: ``actor``
(``ActorConfig``: the clip ratios, ``tis_imp_ratio_cap``, ``loss_agg_mode``,
``loss_scale_factor``) and ``async_training`` (which log-probs anchor the ratio).

The loss is ``agg_loss(l, mask, loss_agg_mode, ...)`` (see ``aggregation``). This is verl's
``compute_policy_loss_vanilla`` with ``rollout_is_weights = w`` (token-level truncated IS).

Which log-probs are ``old`` and ``behav`` (:func:`resolve_log_probs`):

- ``use_rollout_log_probs`` (fully-async default): ``old = rollout``, no weight (it would be 1).
- ``compute_prox_log_prob`` (decoupled PPO, AReaL): ``old = prox`` (a trainer forward pass
  before the update), ``behav = rollout``: the clip is anchored at ``pi_prox`` and the rollout
  log-probs enter only through ``w = min(pi_prox / pi_behav, cap)``.
- neither: ``old`` = the trainer's recomputed log-probs, ``behav = rollout`` (verl's TIS).
  The formula is the same as decoupled PPO; only which weights produced ``old`` differs.

With ``tis_imp_ratio_cap=None`` the weight is off, so in the last two modes the rollout
log-probs are then unused (verl's behaviour without rollout IS).

Diagnostics (local masked means over the given tokens, Python floats):
``actor/pg_clipfrac`` (verl: fraction with ``l_2 > l_1``), ``actor/pg_clipfrac_high``
(``A > 0`` and ``r > 1 + clip_ratio_high``), ``actor/pg_clipfrac_low`` (``A < 0`` and
``r < 1 - clip_ratio_low``), ``actor/pg_clipfrac_dual`` (``A < 0`` and ``l_clip > -A c``; verl's
``actor/pg_clipfrac_lower``), ``actor/ppo_kl`` (``mean(old - logp)`` with the clamp, verl's),
``actor/ratio_mean|max|min``; with a weight also ``actor/is_weight_mean|max``,
``actor/is_truncated_frac`` and ``actor/behav_kl`` (``mean(behav - old)``, the k1 estimate of
KL(pi_behav || pi_old)). ``pg_clipfrac == pg_clipfrac_high + pg_clipfrac_low``.

``actor/pg_clipfrac*`` count the clipped *values* in every mode (GSPO: sequences' ratios; CISPO:
the clipped weights). Not covered: value loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer_daemon.algo.aggregation import agg_loss, masked_mean
from trainer_daemon.algo.rollout_correction import LOG_RATIO_BOUND, active, correction_weights

if TYPE_CHECKING:
    from asyncrl.config.sections_core import AsyncTrainingConfig
    from asyncrl.config.sections_infra import ActorConfig

_LOG_RATIO_BOUND = LOG_RATIO_BOUND


def resolve_log_probs(
    async_training: AsyncTrainingConfig,
    rollout_log_prob: torch.Tensor,
    recomputed_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(old_log_prob, behav_log_prob or None)`` for :func:`compute_policy_loss` (see module doc).

    ``recomputed_log_prob`` is the trainer's no-grad forward pass before the update (``pi_prox``);
    it is required when ``async_training.recomputes_log_probs``.
    """
    if not async_training.recomputes_log_probs:
        return rollout_log_prob, None
    if recomputed_log_prob is None:
        raise ValueError(
            "compute_prox_log_prob (or use_rollout_log_probs=False) needs the recomputed log-probs"
        )
    return recomputed_log_prob, rollout_log_prob


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    *,
    rollout_log_prob: torch.Tensor | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
    metrics_on_device: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped PPO loss of the module doc and its diagnostics.

    Args:
        log_prob: ``(B, T)`` current policy log-probs (with grad).
        old_log_prob: ``(B, T)`` anchor log-probs (treated as constants).
        advantages: ``(B, T)`` per-token advantages.
        response_mask: ``(B, T)`` 0/1 loss mask.
        config: the ``actor`` section (clip ratios, ``tis_imp_ratio_cap``, ``loss_agg_mode``,
            ``loss_scale_factor``); its bounds are the loss's preconditions.
        rollout_log_prob: ``(B, T)`` behaviour log-probs for the truncated IS weight, or None.
        global_tokens, global_seqs, dp_size: mini-batch normalisers, see ``aggregation.agg_loss``.

        metrics_on_device: leave the diagnostics as detached 0-dim tensors where they were
            computed (no host synchronisation: the step reads them once per step).

    Returns:
        ``(loss, metrics)``: a 0-dim tensor and a dict of floats (or of 0-dim tensors).
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            "log_prob, old_log_prob, advantages and response_mask must have one (B, T) shape"
        )
    old = old_log_prob.detach()
    adv = advantages.detach().to(log_prob.dtype)
    lo, hi = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    negative = adv < 0
    dual = torch.zeros_like(negative)
    if config.loss_mode == "gspo":
        m = response_mask.to(log_prob.dtype)
        seq_log = ((log_prob - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        log_ratio = torch.clamp(seq_log.detach() + log_prob - log_prob.detach(), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, lo, hi)
        losses = torch.maximum(l1, l2)
    elif config.loss_mode == "cispo":
        log_ratio = torch.clamp(log_prob - old, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        l1 = -adv * ratio.detach()
        l2 = -adv * torch.clamp(ratio.detach(), lo, hi)
        losses = -torch.clamp(ratio, lo, hi).detach() * adv * log_prob
    else:
        log_ratio = torch.clamp(log_prob - old, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        ratio = torch.exp(log_ratio)
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, lo, hi)
        l_clip = torch.maximum(l1, l2)
        if config.clip_ratio_c is not None:
            l3 = -adv * config.clip_ratio_c
            losses = torch.where(negative, torch.minimum(l_clip, l3), l_clip)
            dual = (l_clip > l3) & negative
        else:
            losses = l_clip

    weight, is_stats = None, {}
    if rollout_log_prob is not None and active(config):
        weight, is_stats = correction_weights(old, rollout_log_prob, response_mask, config)
        losses = losses * weight.to(losses.dtype)

    loss = agg_loss(
        losses,
        response_mask,
        config.loss_agg_mode,
        global_tokens,
        global_seqs,
        dp_size=dp_size,
        loss_scale_factor=config.loss_scale_factor,
    )

    with torch.no_grad():
        mask = response_mask.bool()
        r = ratio.detach().to(torch.float64)
        clipped = l2.detach() > l1.detach()
        stats = {  # computed on the device, moved to the host in one transfer
            "actor/pg_clipfrac": masked_mean(clipped.double(), mask),
            "actor/pg_clipfrac_high": masked_mean((clipped & (r > hi)).double(), mask),
            "actor/pg_clipfrac_low": masked_mean((clipped & (r < lo)).double(), mask),
            "actor/pg_clipfrac_dual": masked_mean(dual.double(), mask),
            "actor/ppo_kl": masked_mean(-log_ratio.detach().double(), mask),
            "actor/ratio_mean": masked_mean(r, mask),
            "actor/ratio_max": _masked_extreme(r, mask, largest=True),
            "actor/ratio_min": _masked_extreme(r, mask, largest=False),
        }
        stats.update(is_stats)
        if metrics_on_device:
            return loss, {k: v.detach() for k, v in stats.items()}
        values = torch.stack(list(stats.values())).cpu().tolist()
    return loss, dict(zip(stats, values, strict=True))


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """Max (or min) over the masked entries as a 0-dim tensor; 0 when no entry is selected."""
    picked = torch.where(mask, values, -torch.inf if largest else torch.inf)  # a scalar: no host-to-device copy
    ext = picked.amax() if largest else picked.amin()
    return torch.where(mask.any(), ext, torch.zeros_like(ext))
