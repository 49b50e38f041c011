"""agg_loss against python loops, and micro-batch / data-parallel split equivalence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainer_daemon.algo.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    count_tokens_and_seqs,
    masked_mean,
)

RNG = np.random.default_rng(1234)
LOSS = RNG.normal(size=(6, 7))
MASK = np.array(
    [
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],  # fully masked sequence: excluded from the sequence count
        [1, 0, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0],
    ],
    dtype=np.float64,
)


def loop_agg(loss, mask, mode, scale=None):
    """verl's four modes written as plain loops over rows and tokens."""
    rows = []
    for i in range(loss.shape[0]):
        toks = [loss[i, t] for t in range(loss.shape[1]) if mask[i, t] == 1]
        rows.append(toks)
    if mode == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / len(flat)
    active = [r for r in rows if r]
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in active) / len(active)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in active) / len(active)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in rows) / (loss.shape[1] if scale is None else scale)
    raise AssertionError(mode)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_single_batch_matches_loops(mode):
    got = agg_loss(torch.tensor(LOSS), torch.tensor(MASK), mode)
    assert math.isclose(got.item(), loop_agg(LOSS, MASK, mode), rel_tol=1e-12)


def test_loss_scale_factor_and_bool_mask():
    got = agg_loss(
        torch.tensor(LOSS),
        torch.tensor(MASK).bool(),
        "seq-mean-token-sum-norm",
        loss_scale_factor=100,
    )
    assert math.isclose(
        got.item(), loop_agg(LOSS, MASK, "seq-mean-token-sum-norm", scale=100), rel_tol=1e-12
    )


def test_masked_entries_do_not_leak_even_if_non_finite():
    loss = torch.tensor(LOSS).clone()
    loss[MASK == 0] = float("nan")
    loss[2, 3] = float("inf")
    for mode in LOSS_AGG_MODES:
        assert math.isclose(
            agg_loss(loss, torch.tensor(MASK), mode).item(),
            loop_agg(LOSS, MASK, mode),
            rel_tol=1e-12,
        )
    assert math.isclose(
        masked_mean(loss, torch.tensor(MASK)).item(),
        loop_agg(LOSS, MASK, "token-mean"),
        rel_tol=1e-12,
    )


def test_empty_mask_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0


def test_count_tokens_and_seqs():
    assert count_tokens_and_seqs(torch.tensor(MASK)) == (int(MASK.sum()), 5)


def test_errors():
    with pytest.raises(ValueError):
        agg_loss(torch.ones(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError):
        agg_loss(torch.ones(2, 3), torch.ones(3, 2), "token-mean")


# rank -> micro-batches -> row indices of the 6-row batch (uneven on purpose)
SPLIT = [[[0], [2, 4]], [[1, 3, 5]]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_and_dp_split_equals_unsplit(mode):
    """(1/dp) * sum_ranks sum_micro loss == full loss, and the same for the gradient."""
    dp = len(SPLIT)
    full_leaf = torch.tensor(LOSS, requires_grad=True)
    full = agg_loss(full_leaf, torch.tensor(MASK), mode, loss_scale_factor=7)
    full.backward()

    mask = torch.tensor(MASK)
    parts = [count_tokens_and_seqs(mask[rows]) for rank in SPLIT for rows in rank]
    g_tok, g_seq = sum(p[0] for p in parts), sum(p[1] for p in parts)

    leaf = torch.tensor(LOSS, requires_grad=True)
    rank_sums = []
    rank_grads = []
    for rank in SPLIT:
        if leaf.grad is not None:
            leaf.grad = None
        total = 0.0
        for rows in rank:  # gradient accumulation: backward per micro-batch, grads add up
            micro = agg_loss(
                leaf[rows], mask[rows], mode, g_tok, g_seq, dp_size=dp, loss_scale_factor=7
            )
            micro.backward()
            total += micro.item()
        rank_sums.append(total)
        rank_grads.append(leaf.grad.clone())
    averaged_grad = sum(rank_grads) / dp  # what FSDP's mean all-reduce produces
    assert math.isclose(sum(rank_sums) / dp, full.item(), rel_tol=1e-12)
    torch.testing.assert_close(averaged_grad, full_leaf.grad, rtol=1e-12, atol=1e-14)


def test_local_normalisers_would_be_wrong():
    """Guard that the split test can fail: per-micro-batch means do not add up to the full mean."""
    mask = torch.tensor(MASK)
    loss = torch.tensor(LOSS)
    local = (
        sum(agg_loss(loss[rows], mask[rows], "token-mean") for rank in SPLIT for rows in rank) / 3
    )
    assert not math.isclose(local.item(), agg_loss(loss, mask, "token-mean").item(), rel_tol=1e-6)
