"""Off-policy corrections and objectives on fixed tensors, against numbers computed here with
plain Python math (not by calling the product's code): RLOO advantages, sequence-level TIS,
MIS / IcePop / sequence and geometric rejection, GSPO and CISPO losses and their gradients."""

from __future__ import annotations

import math

import torch

from asyncrl.config.sections_infra import ActorConfig
from trainer_daemon.algo.advantages import outcome_advantages
from trainer_daemon.algo.policy_loss import compute_policy_loss
from trainer_daemon.algo.rollout_correction import correction_weights

# two sequences, three positions; the last position of row 1 is padding
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -9.0]]
OLD = [[-1.1, -0.4, -2.3], [-0.2, -1.6, -9.0]]
BEHAV = [[-1.9, -0.45, -2.2], [-0.1, -1.5, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
ADV = [[1.5, 1.5, 1.5], [-0.8, -0.8, -0.8]]


def t(rows, grad=False):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=grad)


def cells():
    return [(i, j) for i in range(2) for j in range(3) if MASK[i][j]]


def test_rloo_baseline_is_the_mean_of_the_others():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 2.0, 3.0, 1.0]
    groups = ["a", "a", "a", "a", "b", "c", "c", "d", "d"]
    want = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        same = [rewards[j] for j in range(len(rewards)) if groups[j] == g]
        want.append(0.0 if not others or len(set(same)) == 1 else r - sum(others) / len(others))
    got = outcome_advantages(torch.tensor(rewards), groups, "rloo").tolist()
    assert all(math.isclose(a, b, abs_tol=1e-12) for a, b in zip(got, want, strict=True)), (got, want)
    assert [round(x, 12) for x in want[:4]] == [round(x, 12) for x in (2 / 3, -2 / 3, -2 / 3, 2 / 3)] and want[7:] == [2.0, -2.0]
    assert want[4:7] == [0.0, 0.0, 0.0]  # a group of one, a constant group
    grpo = outcome_advantages(torch.tensor(rewards), groups, "grpo", norm_by_std=False).tolist()
    assert math.isclose(got[0], grpo[0] * 4 / 3) and math.isclose(got[7], grpo[7] * 2)  # n/(n-1) of Dr. GRPO's


def _d(i, j):
    return OLD[i][j] - BEHAV[i][j]


def test_sequence_level_tis_weights_every_token_by_the_capped_product():
    w, stats = correction_weights(t(OLD), t(BEHAV), t(MASK), ActorConfig(rollout_is_level="sequence", tis_imp_ratio_cap=1.5))
    for i in range(2):
        rho = math.exp(sum(_d(i, j) for j in range(3) if MASK[i][j]))
        for j in range(3):
            assert math.isclose(w[i, j].item(), min(rho, 1.5), rel_tol=1e-12)
    rhos = [math.exp(sum(_d(i, j) for j in range(3) if MASK[i][j])) for i in range(2)]
    trunc = sum(MASK[i][j] * (rhos[i] > 1.5) for i, j in cells()) / len(cells())
    assert math.isclose(stats["actor/is_truncated_frac"].item(), trunc)


def test_masked_is_and_icepop_zero_the_tokens_outside_the_bounds():
    # MIS, token level, no cap: the raw ratio inside [1/2, 2], 0 outside
    w, stats = correction_weights(t(OLD), t(BEHAV), t(MASK), ActorConfig(tis_imp_ratio_cap=None, rollout_rs="token"))
    masked = 0
    for i, j in cells():
        rho = math.exp(_d(i, j))
        inside = 0.5 <= rho <= 2.0
        masked += not inside
        assert math.isclose(w[i, j].item(), rho if inside else 0.0, rel_tol=1e-12), (i, j, rho)
    assert masked == 1  # exp(0.8) = 2.23 is out
    assert math.isclose(stats["actor/rs_masked_frac"].item(), masked / len(cells()))
    # IcePop: token masking with a tighter two-sided band [0.8, 1.2]
    w, _ = correction_weights(t(OLD), t(BEHAV), t(MASK), ActorConfig(tis_imp_ratio_cap=None, rollout_rs="token",
                                                                     rollout_rs_threshold=1.2, rollout_rs_threshold_lower=0.8))
    for i, j in cells():
        rho = math.exp(_d(i, j))
        assert math.isclose(w[i, j].item(), rho if 0.8 <= rho <= 1.2 else 0.0, rel_tol=1e-12), (i, j, rho)


def test_sequence_and_geometric_rejection_mask_whole_sequences():
    seq = [sum(_d(i, j) for j in range(3) if MASK[i][j]) for i in range(2)]
    geo = [seq[i] / sum(MASK[i]) for i in range(2)]
    for level, logs in (("sequence", seq), ("geometric", geo)):
        cfg = ActorConfig(tis_imp_ratio_cap=2.0, rollout_rs=level, rollout_rs_threshold=1.5)
        w, _ = correction_weights(t(OLD), t(BEHAV), t(MASK), cfg)
        for i, j in cells():
            keep = 1 / 1.5 <= math.exp(logs[i]) <= 1.5
            want = min(math.exp(_d(i, j)), 2.0) if keep else 0.0  # the IS weight stays at token level
            assert math.isclose(w[i, j].item(), want, rel_tol=1e-12), (level, i, j)
    assert math.exp(seq[0]) > 1.5 > math.exp(geo[0])  # the two levels decide differently for row 0


def test_gspo_clips_the_sequence_ratio_and_spreads_its_gradient():
    cfg = ActorConfig(loss_mode="gspo", clip_ratio_low=0.05, clip_ratio_high=0.05, loss_agg_mode="seq-mean-token-mean",
                      tis_imp_ratio_cap=None)
    logp = t(LOGP, grad=True)
    loss, m = compute_policy_loss(logp, t(OLD), t(ADV), t(MASK), cfg)
    want, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    clipped_rows = []
    for i in range(2):
        n = sum(MASK[i])
        s = math.exp(sum(LOGP[i][j] - OLD[i][j] for j in range(3) if MASK[i][j]) / n)
        a = ADV[i][0]
        l1, l2 = -a * s, -a * min(max(s, 0.95), 1.05)
        if l2 > l1:
            clipped_rows.append(i)
        want += max(l1, l2) / 2  # seq-mean-token-mean: (1/B) sum_i (1/n_i) sum_t l_i (same value on each token)
        for j in range(3):
            if MASK[i][j]:
                grad[i][j] = (0.0 if l2 > l1 else -a * s) / (2 * n)
    assert clipped_rows == [0]  # row 0: s = e^0.1 > 1.05 with A > 0; row 1: s = e^0.15 with A < 0 is not
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-14)
    assert math.isclose(m["actor/pg_clipfrac"], sum(MASK[0]) / len(cells()))


def test_cispo_puts_the_clipped_detached_weight_on_the_log_prob():
    cfg = ActorConfig(loss_mode="cispo", clip_ratio_low=0.1, clip_ratio_high=0.2, tis_imp_ratio_cap=None)
    logp = t(LOGP, grad=True)
    loss, _ = compute_policy_loss(logp, t(OLD), t(ADV), t(MASK), cfg)
    n = len(cells())
    want = sum(-min(max(math.exp(LOGP[i][j] - OLD[i][j]), 0.9), 1.2) * ADV[i][j] * LOGP[i][j] for i, j in cells()) / n
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    loss.backward()
    grad = [[0.0] * 3 for _ in range(2)]
    for i, j in cells():  # every token keeps a gradient, clipped or not
        grad[i][j] = -min(max(math.exp(LOGP[i][j] - OLD[i][j]), 0.9), 1.2) * ADV[i][j] / n
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-14)
    assert all(logp.grad[i, j].item() != 0.0 for i, j in cells())


def test_the_correction_multiplies_the_policy_loss():
    cfg = ActorConfig(clip_ratio_low=0.5, clip_ratio_high=0.5, clip_ratio_c=None, tis_imp_ratio_cap=None, rollout_rs="token")
    logp = t(LOGP, grad=True)
    loss, m = compute_policy_loss(logp, t(OLD), t(ADV), t(MASK), cfg, rollout_log_prob=t(BEHAV))
    want = 0.0
    for i, j in cells():
        r, rho = math.exp(LOGP[i][j] - OLD[i][j]), math.exp(_d(i, j))
        assert 0.5 < r < 1.5  # no PPO clipping in this case: l = -A r
        want += (rho if 0.5 <= rho <= 2.0 else 0.0) * -ADV[i][j] * r
    assert math.isclose(loss.item(), want / len(cells()), rel_tol=1e-12)
    assert m["actor/rs_masked_frac"] > 0 and "actor/is_weight_mean" in m
