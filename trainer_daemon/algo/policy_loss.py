"""PPO clipped policy loss with asymmetric clip, dual clip and truncated importance sampling.

Per token, with ``logp`` the current policy's log-prob (gradient flows here), ``old`` the
*anchor* log-prob (``pi_old``; ``pi_prox`` in decoupled PPO), ``A`` the advantage:

    r      = exp(clamp(logp - old, -20, 20))
    l_1    = -A * r
    l_2    = -A * clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)
    l_clip = max(l_1, l_2)
    l      = min(l_clip, -A * clip_ratio_c)  if A < 0 and clip_ratio_c is not None   (dual clip)
           = l_clip                          otherwise

and, when a behaviour log-prob ``behav`` (the rollout engine's) is given and
``tis_imp_ratio_cap`` is not None, a constant (detached) truncated importance weight

    w = min(exp(clamp(old - behav, -20, 20)), tis_imp_ratio_cap),   l <- w * l.

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

Not covered: GSPO / sequence-level ratios, sequence-level IS or rejection sampling, value loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer_daemon.algo.aggregation import LOSS_AGG_MODES, agg_loss, masked_mean
from trainer_daemon.algo.kl import KL_TYPES

_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class PolicyLossConfig:
    """The actor-loss knobs, mirroring ``ActorConfig`` / ``AsyncTrainingConfig`` (same names, same defaults)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    """``C`` of seq-mean-token-sum-norm (None: the padded response length); not in ActorConfig yet."""
    tis_imp_ratio_cap: float | None = 2.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    use_rollout_log_probs: bool = True
    compute_prox_log_prob: bool = False

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_ratio_low < 1.0) or self.clip_ratio_high < 0.0:
            raise ValueError(
                f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {self.clip_ratio_low}, {self.clip_ratio_high}"
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 (or None), got {self.clip_ratio_c}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode {self.loss_agg_mode!r} not in {LOSS_AGG_MODES}")
        if self.tis_imp_ratio_cap is not None and not self.tis_imp_ratio_cap > 0.0:
            raise ValueError(
                f"tis_imp_ratio_cap must be > 0 (or None), got {self.tis_imp_ratio_cap}"
            )
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(f"kl_loss_type {self.kl_loss_type!r} not in {KL_TYPES}")

    @classmethod
    def from_configs(
        cls, actor: Any, async_training: Any = None, **overrides: Any
    ) -> PolicyLossConfig:
        """Build from an ``ActorConfig``-like and an ``AsyncTrainingConfig``-like object (read by attribute)."""
        kwargs = {
            name: getattr(actor, name)
            for name in (
                "clip_ratio_low",
                "clip_ratio_high",
                "clip_ratio_c",
                "loss_agg_mode",
                "tis_imp_ratio_cap",
                "use_kl_loss",
                "kl_loss_coef",
                "kl_loss_type",
                "entropy_coeff",
                "loss_scale_factor",
            )
            if hasattr(actor, name)
        }
        if async_training is not None:
            for name in ("use_rollout_log_probs", "compute_prox_log_prob"):
                kwargs[name] = getattr(async_training, name)
        kwargs.update(overrides)
        return cls(**kwargs)


def resolve_log_probs(
    config: PolicyLossConfig,
    rollout_log_prob: torch.Tensor,
    recomputed_log_prob: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(old_log_prob, behav_log_prob or None)`` for :func:`compute_policy_loss` (see module doc).

    ``recomputed_log_prob`` is the trainer's no-grad forward pass before the update (``pi_prox``);
    it is required unless ``use_rollout_log_probs`` is set and ``compute_prox_log_prob`` is not.
    """
    if config.use_rollout_log_probs and not config.compute_prox_log_prob:
        return rollout_log_prob, None
    if recomputed_log_prob is None:
        raise ValueError(
            "compute_prox_log_prob (or use_rollout_log_probs=False) needs the recomputed log-probs"
        )
    return recomputed_log_prob, rollout_log_prob


def truncated_is_weight(
    old_log_prob: torch.Tensor, behav_log_prob: torch.Tensor, cap: float
) -> torch.Tensor:
    """Detached ``min(exp(clamp(old - behav, -20, 20)), cap)``, same shape as the inputs."""
    log_w = torch.clamp(
        old_log_prob.detach() - behav_log_prob.detach(), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND
    )
    return torch.exp(log_w).clamp(max=cap)


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_prob: torch.Tensor | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped PPO loss of the module doc and its diagnostics.

    Args:
        log_prob: ``(B, T)`` current policy log-probs (with grad).
        old_log_prob: ``(B, T)`` anchor log-probs (treated as constants).
        advantages: ``(B, T)`` per-token advantages.
        response_mask: ``(B, T)`` 0/1 loss mask.
        config: loss knobs.
        rollout_log_prob: ``(B, T)`` behaviour log-probs for the truncated IS weight, or None.
        global_tokens, global_seqs, dp_size: mini-batch normalisers, see ``aggregation.agg_loss``.

    Returns:
        ``(loss, metrics)``: a 0-dim tensor and a dict of floats.
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            "log_prob, old_log_prob, advantages and response_mask must have one (B, T) shape"
        )
    old = old_log_prob.detach()
    adv = advantages.detach().to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old, -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    lo, hi = 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, lo, hi)
    l_clip = torch.maximum(l1, l2)
    negative = adv < 0
    if config.clip_ratio_c is not None:
        l3 = -adv * config.clip_ratio_c
        losses = torch.where(negative, torch.minimum(l_clip, l3), l_clip)
        dual = (l_clip > l3) & negative
    else:
        losses = l_clip
        dual = torch.zeros_like(negative)

    weight = None
    if rollout_log_prob is not None and config.tis_imp_ratio_cap is not None:
        weight = truncated_is_weight(old, rollout_log_prob, config.tis_imp_ratio_cap).to(
            losses.dtype
        )
        losses = losses * weight

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
        if weight is not None:
            raw_log_w = (
                (old - rollout_log_prob.detach())
                .clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
                .double()
            )
            w = weight.double()
            stats["actor/is_weight_mean"] = masked_mean(w, mask)
            stats["actor/is_weight_max"] = _masked_extreme(w, mask, largest=True)
            stats["actor/is_truncated_frac"] = masked_mean(
                (raw_log_w.exp() > config.tis_imp_ratio_cap).double(), mask
            )
            stats["actor/behav_kl"] = masked_mean(-raw_log_w, mask)
        values = torch.stack(list(stats.values())).cpu().tolist()
    return loss, dict(zip(stats, values, strict=True))


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, *, largest: bool) -> torch.Tensor:
    """Max (or min) over the masked entries as a 0-dim tensor; 0 when no entry is selected."""
    fill = torch.tensor(
        -torch.inf if largest else torch.inf, dtype=values.dtype, device=values.device
    )
    picked = torch.where(mask, values, fill)
    ext = picked.amax() if largest else picked.amin()
    return torch.where(mask.any(), ext, torch.zeros_like(ext))
