"""GRPO advantages against a direct per-group computation (python statistics)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer_daemon.algo.advantages import (
    grpo_advantages,
    grpo_token_advantages,
    zero_variance_groups,
    zero_variance_mask,
)

# Groups interleaved on purpose: "a" (mixed, 4), "b" (size 1), "c" (all equal), "d" (2, spread).
GIDS = ["a", "b", "a", "c", "d", "a", "c", "d", "a", "c"]
REWARDS = [1.0, 0.5, 0.0, 0.1, -1.0, 1.0, 0.1, 2.0, 0.25, 0.1]


def expected(rewards, gids, norm, eps=1e-6):
    out = []
    for r, g in zip(rewards, gids, strict=True):
        members = [x for x, h in zip(rewards, gids, strict=True) if h == g]
        if len(members) < 2 or len(set(members)) == 1:
            out.append(0.0)
            continue
        mu = statistics.fmean(members)
        sd = statistics.stdev(members)  # sample std (n - 1), as torch.std
        out.append((r - mu) / (sd + eps) if norm else r - mu)
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_advantages_match_per_group_formula(norm):
    got = grpo_advantages(torch.tensor(REWARDS), GIDS, norm_by_std=norm)
    want = expected(REWARDS, GIDS, norm)
    assert got.dtype == torch.float64
    for g, w in zip(got.tolist(), want, strict=True):
        assert math.isclose(g, w, rel_tol=1e-12, abs_tol=1e-12)
    # spot checks that make the conventions explicit
    assert got[1].item() == 0.0  # size-1 group
    assert got[3].item() == got[6].item() == got[9].item() == 0.0  # zero variance, exactly
    if norm:  # group d = {-1, 2}: mean 0.5, sample std sqrt(4.5)
        assert math.isclose(got[4].item(), -1.5 / (math.sqrt(4.5) + 1e-6), rel_tol=1e-12)


def test_grpo_epsilon_and_tensor_group_ids():
    rewards = torch.tensor([0.0, 1e-7, 5.0, 7.0], dtype=torch.float64)
    gids = torch.tensor([3, 3, 9, 9])
    got = grpo_advantages(rewards, gids, epsilon=1e-3)
    sd = statistics.stdev([0.0, 1e-7])
    assert math.isclose(got[0].item(), (0.0 - 0.5e-7) / (sd + 1e-3), rel_tol=1e-9)
    assert math.isclose(got[2].item(), -1.0 / (math.sqrt(2.0) + 1e-3), rel_tol=1e-12)


def test_token_advantages_broadcast_by_mask():
    mask = torch.zeros(len(REWARDS), 5)
    lengths = [5, 1, 3, 4, 0, 2, 5, 5, 1, 3]
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    mask[2, 1] = 0.0  # a hole (tool tokens) inside a response
    got = grpo_token_advantages(torch.tensor(REWARDS), GIDS, mask)
    want = expected(REWARDS, GIDS, True)
    assert got.shape == (10, 5) and got.dtype == torch.float32
    for i in range(10):
        for t in range(5):
            w = want[i] if mask[i, t] == 1 else 0.0
            assert math.isclose(got[i, t].item(), w, rel_tol=1e-6, abs_tol=1e-7)
    assert grpo_token_advantages(torch.tensor(REWARDS), GIDS, mask.bool()).dtype == torch.float32
    assert grpo_token_advantages(torch.tensor(REWARDS), GIDS, mask.double()).dtype == torch.float64


def test_zero_variance_detection():
    mask = zero_variance_mask(torch.tensor(REWARDS), GIDS)
    want = [g in ("b", "c") for g in GIDS]
    assert mask.tolist() == want
    assert zero_variance_groups(torch.tensor(REWARDS), GIDS) == ["b", "c"]
    assert zero_variance_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), ["x", "x", "y", "y"]) == ["x"]


def test_shape_errors():
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 2.0]), ["a"])
    with pytest.raises(ValueError):
        grpo_token_advantages(torch.tensor([1.0, 2.0]), ["a", "a"], torch.ones(3, 4))
