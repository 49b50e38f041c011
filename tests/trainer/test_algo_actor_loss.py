"""Actor loss = policy loss - entropy bonus + KL loss, checked against numpy; split equivalence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.config.sections_infra import ActorConfig
from trainer_daemon.algo.actor_loss import compute_actor_loss
from trainer_daemon.algo.aggregation import count_tokens_and_seqs

RNG = np.random.default_rng(99)
B, T = 5, 6
OLD = -RNG.uniform(0.1, 3.0, size=(B, T))
LOGP = OLD + RNG.normal(scale=0.4, size=(B, T))
REF = OLD + RNG.normal(scale=0.3, size=(B, T))
ADV = np.repeat(RNG.normal(size=(B, 1)), T, axis=1)
ENT = RNG.uniform(0.0, 2.0, size=(B, T))
MASK = (RNG.uniform(size=(B, T)) < 0.7).astype(np.float64)
MASK[3] = 0.0
MASK[0, 0] = 1.0


def np_pg(el, eh, c):
    r = np.exp(LOGP - OLD)
    l_clip = np.maximum(-ADV * r, -ADV * np.clip(r, 1 - el, 1 + eh))
    return np.where(ADV < 0, np.minimum(l_clip, -ADV * c), l_clip)


def np_seq_mean_token_mean(mat):
    rows = [mat[i][MASK[i] == 1].mean() for i in range(B) if MASK[i].sum() > 0]
    return float(np.mean(rows))


def t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def test_total_loss_with_entropy_and_kl():
    cfg = ActorConfig(
        loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="mse",
    )
    loss, m = compute_actor_loss(
        t(LOGP, True), t(OLD), t(ADV), t(MASK), cfg, entropy=t(ENT), ref_log_prob=t(REF)
    )
    pg = np_seq_mean_token_mean(np_pg(0.2, 0.28, 3.0))
    ent = np_seq_mean_token_mean(ENT)
    kl = np_seq_mean_token_mean(0.5 * (LOGP - REF) ** 2)
    assert math.isclose(m["actor/pg_loss"], pg, rel_tol=1e-12)
    assert math.isclose(m["actor/entropy"], ent, rel_tol=1e-12)
    assert math.isclose(m["actor/kl_loss"], kl, rel_tol=1e-12)
    assert m["actor/kl_coef"] == 0.1
    assert math.isclose(loss.item(), pg - 0.01 * ent + 0.1 * kl, rel_tol=1e-12)


def test_entropy_gradient_sign_and_missing_inputs():
    ent = t(ENT, True)
    cfg = ActorConfig(entropy_coeff=0.5)
    loss, _ = compute_actor_loss(t(LOGP), t(OLD), t(ADV), t(MASK), cfg, entropy=ent)
    loss.backward()
    n = MASK.sum()
    np.testing.assert_allclose(ent.grad.numpy(), -0.5 * MASK / n, rtol=1e-12)  # maximise entropy
    with pytest.raises(ValueError):
        compute_actor_loss(t(LOGP), t(OLD), t(ADV), t(MASK), cfg)
    with pytest.raises(ValueError):
        compute_actor_loss(t(LOGP), t(OLD), t(ADV), t(MASK), ActorConfig(use_kl_loss=True))


def test_entropy_reported_without_bonus():
    loss, m = compute_actor_loss(
        t(LOGP), t(OLD), t(ADV), t(MASK), ActorConfig(), entropy=t(ENT)
    )
    assert math.isclose(m["actor/entropy"], float((ENT * MASK).sum() / MASK.sum()), rel_tol=1e-12)
    assert math.isclose(loss.item(), m["actor/pg_loss"], rel_tol=1e-12)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batch_split_gradient_equals_full(mode):
    cfg = ActorConfig(
        loss_agg_mode=mode,
        entropy_coeff=0.02,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        loss_scale_factor=T,
    )
    full_lp = t(LOGP, True)
    full, _ = compute_actor_loss(
        full_lp,
        t(OLD),
        t(ADV),
        t(MASK),
        cfg,
        entropy=t(ENT),
        ref_log_prob=t(REF),
        rollout_log_prob=t(OLD - 0.3),
    )
    full.backward()
    split = [[0, 4], [1], [2, 3]]  # one rank, three micro-batches (one fully masked row included)
    g_tok = sum(count_tokens_and_seqs(t(MASK)[rows])[0] for rows in split)
    g_seq = sum(count_tokens_and_seqs(t(MASK)[rows])[1] for rows in split)
    lp = t(LOGP, True)
    total = 0.0
    for rows in split:
        part, _ = compute_actor_loss(
            lp[rows],
            t(OLD)[rows],
            t(ADV)[rows],
            t(MASK)[rows],
            cfg,
            entropy=t(ENT)[rows],
            ref_log_prob=t(REF)[rows],
            rollout_log_prob=t(OLD - 0.3)[rows],
            global_tokens=g_tok,
            global_seqs=g_seq,
        )
        part.backward()
        total += part.item()
    assert math.isclose(total, full.item(), rel_tol=1e-12)
    torch.testing.assert_close(lp.grad, full_lp.grad, rtol=1e-12, atol=1e-15)


def test_metrics_can_stay_on_the_device_with_the_same_values():
    """The step asks for device tensors (no host synchronisation per micro-batch: issue 31)."""
    cfg = ActorConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, tis_imp_ratio_cap=2.0)
    args = (t(LOGP, True), t(OLD), t(ADV), t(MASK), cfg)
    kw = dict(entropy=t(ENT), ref_log_prob=t(REF), rollout_log_prob=t(OLD - 0.1))
    loss, floats = compute_actor_loss(*args, **kw)
    loss_d, tensors = compute_actor_loss(*args, **kw, metrics_on_device=True)
    assert loss_d.item() == loss.item() and floats.keys() == tensors.keys()
    for k, v in tensors.items():
        if k == "actor/kl_coef":
            assert v == floats[k]
            continue
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, k
        assert v.item() == floats[k], k
