"""PPO clipped loss (asymmetric clip, dual clip, truncated IS) against a per-token case analysis."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.sections_core import AsyncTrainingConfig
from asyncrl.config.sections_infra import ActorConfig
from trainer_daemon.algo.policy_loss import (
    compute_policy_loss,
    resolve_log_probs,
)
from trainer_daemon.algo.rollout_correction import correction_weights

EL, EH, C = 0.2, 0.28, 3.0
# (advantage, ratio, mask) per token; two rows of six.
TOKENS = [
    [(1.5, 1.1, 1), (1.5, 1.5, 1), (1.5, 0.5, 1), (-0.7, 0.9, 1), (-0.7, 0.5, 1), (-0.7, 1.5, 1)],
    [(-2.0, 5.0, 1), (0.0, 1.7, 1), (0.3, 1.0, 1), (5.0, 100.0, 0), (-1.0, 2.9, 1), (1.0, 0.1, 0)],
]
OLD = [[-1.0 - 0.3 * (i * 6 + t) for t in range(6)] for i in range(2)]
# raw behaviour weights pi_old / pi_rollout per token (cap 2.0 truncates 3.0 and 2.5)
RAW_W = [[1.0, 0.5, 3.0, 1.2, 0.9, 2.5], [0.7, 1.0, 2.0, 9.0, 1.1, 0.2]]


def tensors():
    adv = torch.tensor([[a for a, _, _ in row] for row in TOKENS], dtype=torch.float64)
    ratio = torch.tensor([[r for _, r, _ in row] for row in TOKENS], dtype=torch.float64)
    mask = torch.tensor([[m for _, _, m in row] for row in TOKENS], dtype=torch.float64)
    old = torch.tensor(OLD, dtype=torch.float64)
    logp = (old + ratio.log()).clone().requires_grad_(True)
    rollout = old - torch.tensor(RAW_W, dtype=torch.float64).log()
    return logp, old, adv, mask, rollout


def token_case(a, r, dual_c):
    """Pessimistic PPO objective by cases; returns (loss, d loss / d logp)."""
    if a >= 0:  # objective a * min(r, 1 + eh): the gradient dies above the upper clip
        loss, grad = (-a * r, -a * r) if r < 1 + EH else (-a * (1 + EH), 0.0)
    else:  # objective a * max(r, 1 - el): the gradient dies below the lower clip
        loss, grad = (-a * r, -a * r) if r > 1 - EL else (-a * (1 - EL), 0.0)
        if dual_c is not None and loss > -a * dual_c:  # dual clip caps the loss of a < 0
            loss, grad = -a * dual_c, 0.0
    return loss, grad


def expected(dual_c=C, weights=None, cap=2.0):
    n = sum(m for row in TOKENS for _, _, m in row)
    loss, grads = 0.0, [[0.0] * 6 for _ in range(2)]
    for i, row in enumerate(TOKENS):
        for t, (a, r, m) in enumerate(row):
            if not m:
                continue
            w = 1.0 if weights is None else min(weights[i][t], cap)
            lt, gt = token_case(a, r, dual_c)
            loss += w * lt / n
            grads[i][t] = w * gt / n
    return loss, torch.tensor(grads, dtype=torch.float64)


def test_clipped_loss_value_gradient_and_metrics():
    logp, old, adv, mask, _ = tensors()
    loss, m = compute_policy_loss(logp, old, adv, mask, ActorConfig())
    want, want_grad = expected()
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-10, atol=1e-14)
    # clipped and dual-clipped tokens get exactly zero gradient
    assert (
        logp.grad[0, 1].item() == 0.0
        and logp.grad[0, 4].item() == 0.0
        and logp.grad[1, 0].item() == 0.0
    )

    active = [(a, r) for row in TOKENS for a, r, mk in row if mk]
    n = len(active)
    high = sum(a > 0 and r > 1 + EH for a, r in active) / n
    low = sum(a < 0 and r < 1 - EL for a, r in active) / n
    dual = sum(a < 0 and r > C for a, r in active) / n
    assert (high, low, dual) == (0.1, 0.1, 0.1)
    assert math.isclose(m["actor/pg_clipfrac_high"], high) and math.isclose(
        m["actor/pg_clipfrac_low"], low
    )
    assert math.isclose(m["actor/pg_clipfrac"], high + low)
    assert math.isclose(m["actor/pg_clipfrac_dual"], dual)
    assert math.isclose(m["actor/ppo_kl"], sum(-math.log(r) for _, r in active) / n, rel_tol=1e-6)
    assert math.isclose(m["actor/ratio_mean"], sum(r for _, r in active) / n, rel_tol=1e-6)
    assert math.isclose(m["actor/ratio_max"], 5.0, rel_tol=1e-9) and math.isclose(
        m["actor/ratio_min"], 0.5, rel_tol=1e-9
    )
    assert "actor/is_weight_mean" not in m


def test_dual_clip_off():
    logp, old, adv, mask, _ = tensors()
    loss, m = compute_policy_loss(logp, old, adv, mask, ActorConfig(clip_ratio_c=None))
    want, want_grad = expected(dual_c=None)
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-10, atol=1e-14)
    assert logp.grad[1, 0].item() != 0.0 and m["actor/pg_clipfrac_dual"] == 0.0


def test_truncated_importance_weight():
    logp, old, adv, mask, rollout = tensors()
    loss, m = compute_policy_loss(
        logp, old, adv, mask, ActorConfig(), rollout_log_prob=rollout
    )
    want, want_grad = expected(weights=RAW_W, cap=2.0)
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, want_grad, rtol=1e-10, atol=1e-14)
    active_w = [
        w
        for row_w, row in zip(RAW_W, TOKENS, strict=True)
        for w, (_, _, mk) in zip(row_w, row, strict=True)
        if mk
    ]
    assert math.isclose(
        m["actor/is_weight_mean"], sum(min(w, 2.0) for w in active_w) / len(active_w), rel_tol=1e-9
    )
    assert math.isclose(m["actor/is_weight_max"], 2.0, rel_tol=1e-12)
    assert math.isclose(m["actor/is_truncated_frac"], 2 / 10)  # 3.0 and 2.5; 9.0 is masked
    assert math.isclose(m["actor/behav_kl"], sum(-math.log(w) for w in active_w) / 10, rel_tol=1e-9)
    # cap None switches the weight off entirely
    loss_off, m_off = compute_policy_loss(
        logp, old, adv, mask, ActorConfig(tis_imp_ratio_cap=None), rollout_log_prob=rollout
    )
    assert (
        math.isclose(loss_off.item(), expected()[0], rel_tol=1e-12)
        and "actor/is_weight_mean" not in m_off
    )


def test_truncated_is_weight_is_detached_and_bounded():
    old = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    w, _ = correction_weights(old, torch.tensor([[-1.0, -1.0, 30.0]]), torch.ones(1, 3), ActorConfig())
    assert not w.requires_grad
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, math.exp(-20.0)]]))


def test_seq_mean_token_mean_mode_passes_through():
    logp, old, adv, mask, _ = tensors()
    loss, _ = compute_policy_loss(
        logp, old, adv, mask, ActorConfig(loss_agg_mode="seq-mean-token-mean")
    )
    per_row = []
    for row in TOKENS:
        vals = [token_case(a, r, C)[0] for a, r, mk in row if mk]
        per_row.append(sum(vals) / len(vals))
    assert math.isclose(loss.item(), sum(per_row) / 2, rel_tol=1e-12)


def test_log_ratio_clamp_in_ratio_and_ppo_kl():
    logp = torch.tensor([[25.0, 0.0]], dtype=torch.float64)
    _, m = compute_policy_loss(
        logp,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        torch.tensor([[1.0, 0.0]]),
        ActorConfig(),
    )
    assert m["actor/ppo_kl"] == -20.0 and math.isclose(m["actor/ratio_max"], math.exp(20.0))


def test_resolve_log_probs_modes():
    rollout, recomputed = torch.full((1, 2), -1.0), torch.full((1, 2), -2.0)
    old, behav = resolve_log_probs(AsyncTrainingConfig(), rollout, recomputed)
    assert old is rollout and behav is None
    for cfg in (
        AsyncTrainingConfig(compute_prox_log_prob=True),
        AsyncTrainingConfig(use_rollout_log_probs=False),
        AsyncTrainingConfig(use_rollout_log_probs=False, compute_prox_log_prob=True),
    ):
        old, behav = resolve_log_probs(cfg, rollout, recomputed)
        assert old is recomputed and behav is rollout
        with pytest.raises(ValueError):
            resolve_log_probs(cfg, rollout, None)


def test_the_actor_section_refuses_knobs_the_loss_cannot_use():
    for bad in (
        dict(clip_ratio_c=1.0),
        dict(loss_agg_mode="sum"),
        dict(tis_imp_ratio_cap=0.0),
        dict(kl_loss_type="full"),
        dict(clip_ratio_low=1.0),
        dict(loss_scale_factor=0.0),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ActorConfig(**bad)
    with pytest.raises(ValueError):
        compute_policy_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.ones(3, 2),
            ActorConfig(),
        )


def test_empty_mask_gives_zero_loss_and_metrics():
    z = torch.zeros(2, 3)
    loss, m = compute_policy_loss(
        torch.full((2, 3), -1.0),
        z - 2.0,
        torch.ones(2, 3),
        z,
        ActorConfig(),
        rollout_log_prob=z - 3.0,
    )
    assert loss.item() == 0.0
    assert all(v == 0.0 for v in m.values()) and len(m) == 12
