"""The full actor loss of one micro-batch: policy loss, entropy bonus and KL-to-reference loss.

    loss = pg_loss - entropy_coeff * agg(H, mask) + [use_kl_loss] kl_loss_coef * agg(kl(logp, ref), mask)

with ``pg_loss`` from ``policy_loss.compute_policy_loss``, ``H`` the per-token entropy (from
``logprobs.entropy_from_logits``, with grad), ``kl`` from ``kl.kl_penalty`` with
``kl_loss_type``, and ``agg`` = ``aggregation.agg_loss`` with the *same* ``loss_agg_mode`` and
global normalisers as the policy loss (verl's ``ppo_loss``). Back-propagate the returned
loss of every micro-batch without further scaling; see ``aggregation`` for why that equals the
unsplit mini-batch gradient.

Metrics: the policy-loss diagnostics plus ``actor/pg_loss``, ``actor/entropy`` (when an entropy
is given), ``actor/kl_loss`` and ``actor/kl_coef`` (with ``use_kl_loss``). The three loss values
are this micro-batch's *share* of the mini-batch value when global normalisers are passed:
sum them over micro-batches and average over ranks (verl's ``AggregationType.SUM``); the
fractions and ratio stats are local means.

Not covered: the value (critic) loss and reward-side KL penalties (``use_kl_in_reward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer_daemon.algo.aggregation import agg_loss
from trainer_daemon.algo.kl import kl_penalty
from trainer_daemon.algo.policy_loss import compute_policy_loss

if TYPE_CHECKING:
    from asyncrl.config.sections_infra import ActorConfig


def compute_actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    *,
    rollout_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
    metrics_on_device: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Total actor loss (module doc) and its metrics; all tensors ``(B, T)``. ``config`` is the
    run config's ``actor`` section (``entropy_coeff``, ``use_kl_loss``, ``kl_loss_coef``,
    ``kl_loss_type`` and the policy-loss knobs).

    ``entropy`` is required when ``entropy_coeff != 0`` and ``ref_log_prob`` when ``use_kl_loss``.
    ``metrics_on_device``: the metrics stay detached 0-dim tensors on the loss's device (no
    host synchronisation per micro-batch; the step reads them once per step).
    """
    read = (lambda t: t.detach()) if metrics_on_device else (lambda t: t.detach().item())
    norm = dict(global_tokens=global_tokens, global_seqs=global_seqs)
    agg_kw = dict(dp_size=dp_size, loss_scale_factor=config.loss_scale_factor)
    pg_loss, metrics = compute_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        config,
        rollout_log_prob=rollout_log_prob,
        dp_size=dp_size,
        metrics_on_device=metrics_on_device,
        **norm,
    )
    loss = pg_loss
    metrics["actor/pg_loss"] = read(pg_loss)

    if config.entropy_coeff != 0.0 and entropy is None:
        raise ValueError("entropy_coeff != 0 needs the per-token entropy")
    if entropy is not None:
        ent = agg_loss(entropy, response_mask, config.loss_agg_mode, **norm, **agg_kw)
        metrics["actor/entropy"] = read(ent)
        if config.entropy_coeff != 0.0:
            loss = loss - config.entropy_coeff * ent

    if config.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("use_kl_loss needs ref_log_prob")
        kld = kl_penalty(log_prob, ref_log_prob.detach(), config.kl_loss_type)
        kl_loss = agg_loss(kld, response_mask, config.loss_agg_mode, **norm, **agg_kw)
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = read(kl_loss)
        metrics["actor/kl_coef"] = float(config.kl_loss_coef)
    return loss, metrics
