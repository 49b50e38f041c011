"""DP balancing: fixed examples plus hypothesis properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_daemon.algo.balance import balance_across_ranks, plan_mini_batch, split_micro_batches


def loads(seq_lens, parts):
    return [sum(seq_lens[i] for i in p) for p in parts]


def test_fixed_example_groups_together_equal_counts():
    # 4 groups of 2: token weights a=110, b=30, c=70, d=60 -> best 2-way split {a,b} / {c,d} = 140/130
    lens = [100, 10, 20, 10, 50, 20, 30, 30]
    gids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    ranks = balance_across_ranks(lens, gids, 2)
    assert ranks == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert loads(lens, ranks) == [140, 130]


def test_fixed_example_micro_batches_and_padding_rule():
    lens = [5, 9, 1, 7, 3]
    # heaviest first to the lightest micro-batch with room: 9->m0, 7->m1, 5->m2, 3->m2 (5 < 7, 9; m2 full),
    # 1->m1 (7 < 9) -> loads 9 / 8 / 8
    assert split_micro_batches(lens, [0, 1, 2, 3, 4], 2) == [[1], [2, 3], [0, 4]]
    # a rank with fewer sequences than the common micro-batch count gets empty micro-batches
    assert split_micro_batches(lens, [2], 2, num_micro_batches=3) == [[2], [], []]
    assert split_micro_batches(lens, [], 4) == []
    # 3 groups of 2 on 2 ranks: counts 4 / 2 -> both ranks run 2 micro-batches of size <= 2
    plan = plan_mini_batch([4, 4, 4, 4, 4, 4], [0, 0, 1, 1, 2, 2], 2, 2)
    assert [len(r) for r in plan] == [2, 2]
    assert sorted(len(m) for r in plan for m in r) == [1, 1, 2, 2]
    # a group of 3 and one of 1 on 2 ranks (capacity 2 each): the group of 3 cannot fit, goes to the
    # emptier rank; micro_batch_size 1 -> 3 micro-batches everywhere, rank 1 pads with 2 empty ones
    plan = plan_mini_batch([1, 1, 1, 1], ["x", "x", "x", "y"], 2, 1)
    assert plan == [[[0], [1], [2]], [[3], [], []]]


def test_deterministic_and_errors():
    lens = [3, 1, 4, 1, 5, 9, 2, 6]
    gids = [0, 1, 0, 1, 2, 3, 2, 3]
    assert plan_mini_batch(lens, gids, 2, 1) == plan_mini_batch(list(lens), list(gids), 2, 1)
    with pytest.raises(ValueError):
        balance_across_ranks(lens, gids, 0)
    with pytest.raises(ValueError):
        balance_across_ranks(lens, gids[:-1], 2)
    with pytest.raises(ValueError):
        split_micro_batches(lens, [0], 0)


@st.composite
def equal_groups(draw):
    world = draw(st.integers(1, 6))
    groups = world * draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    lens = draw(st.lists(st.integers(0, 2000), min_size=groups * n, max_size=groups * n))
    order = draw(st.permutations(list(range(groups * n))))
    gids = [f"g{order[i] % groups}" for i in range(groups * n)]  # groups interleaved arbitrarily
    micro = draw(st.integers(1, 5))
    return lens, gids, world, micro


@st.composite
def ragged_groups(draw):
    world = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(1, 5), min_size=0, max_size=12))
    gids = [g for g, s in enumerate(sizes) for _ in range(s)]
    lens = draw(st.lists(st.integers(0, 500), min_size=len(gids), max_size=len(gids)))
    return lens, gids, world, draw(st.integers(1, 4)), draw(st.booleans())


def check_common(lens, gids, world, micro, plan, keep_groups):
    flat = [i for rank in plan for mb in rank for i in mb]
    assert sorted(flat) == list(range(len(lens)))  # every trajectory exactly once
    assert len(plan) == world
    assert len({len(rank) for rank in plan}) == 1  # same number of micro-batches on every rank
    assert all(len(mb) <= micro for rank in plan for mb in rank)
    n_micro = len(plan[0])
    assert n_micro == max((math.ceil(sum(len(mb) for mb in r) / micro) for r in plan), default=0)
    if keep_groups:
        owner = {}
        for r, rank in enumerate(plan):
            for mb in rank:
                for i in mb:
                    assert owner.setdefault(gids[i], r) == r  # no group split across ranks


@settings(max_examples=300, deadline=None)
@given(equal_groups())
def test_properties_equal_groups(case):
    lens, gids, world, micro = case
    plan = plan_mini_batch(lens, gids, world, micro)
    check_common(lens, gids, world, micro, plan, True)
    per_rank = [sum(len(mb) for mb in rank) for rank in plan]
    assert len(set(per_rank)) == 1  # divisible total -> equal sequence count per rank
    assert all(mb for rank in plan for mb in rank)  # and then no padding micro-batch is needed
    group_w = {}
    for length, g in zip(lens, gids, strict=True):
        group_w[g] = group_w.get(g, 0) + length
    rank_loads = [sum(lens[i] for mb in rank for i in mb) for rank in plan]
    assert max(rank_loads) - min(rank_loads) <= max(
        group_w.values()
    )  # imbalance bounded by one group


@settings(max_examples=300, deadline=None)
@given(ragged_groups())
def test_properties_ragged_groups(case):
    lens, gids, world, micro, keep = case
    plan = plan_mini_batch(lens, gids, world, micro, keep_groups=keep)
    check_common(lens, gids, world, micro, plan, keep)
    if not keep and len(lens) % world == 0:
        assert len({sum(len(mb) for mb in rank) for rank in plan}) == 1
        rank_loads = [sum(lens[i] for mb in rank for i in mb) for rank in plan]
        assert max(rank_loads) - min(rank_loads) <= max(lens, default=0)
