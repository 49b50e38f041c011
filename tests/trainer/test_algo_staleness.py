"""Version bookkeeping: span / partial / stale / drop and verl's fully_async metrics."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from trainer_daemon.algo.staleness import (
    StalenessBound,
    batch_version_metrics,
    max_version_lag,
    model_version_range,
    version_info,
)


@dataclass
class T:
    weight_versions: list[int]
    version_start: int
    version_end: int
    group_id: str


BATCH = [
    T([5, 5, -1, 5], 5, 5, "g1"),  # fresh, not partial
    T([3, 3, -1, -1, 4, 5], 3, 5, "g1"),  # partial, span 2, newest == current -> not stale
    T([4, 4], 4, 4, "g2"),  # stale by 1
    T([2, -1, 4], 2, 4, "g2"),  # partial span 2, stale
    T([-1, -1], 3, 3, "g3"),  # no model tokens: falls back to version_start/end
    T([1, 2, 3, 4], 1, 4, "g3"),  # partial span 3, stale
]
CURRENT = 5


def test_version_info_definitions():
    infos = [
        version_info(t.weight_versions, t.version_start, t.version_end, CURRENT, max_lag=3)
        for t in BATCH
    ]
    assert [(i.v_min, i.v_max) for i in infos] == [(5, 5), (3, 5), (4, 4), (2, 4), (3, 3), (1, 4)]
    assert [i.span for i in infos] == [0, 2, 0, 2, 0, 3]
    assert [i.partial for i in infos] == [False, True, False, True, False, True]
    assert [i.lag for i in infos] == [0, 0, 1, 1, 2, 1]
    assert [i.stale for i in infos] == [False, False, True, True, True, True]
    assert [i.oldest_lag for i in infos] == [0, 2, 1, 3, 2, 4]
    assert [i.drop for i in infos] == [
        False,
        False,
        False,
        False,
        False,
        True,
    ]  # only oldest_lag 4 > 3
    assert not version_info([1], 1, 1, 9).drop  # no bound -> never dropped


def test_batch_metrics_match_hand_count():
    m = batch_version_metrics(BATCH, CURRENT, prev_stale_samples=7, prev_stale_trajectories=11)
    # groups' newest tokens: g1 -> 5 (fresh), g2 -> 4 (stale), g3 -> 4 (stale)
    assert m["fully_async/count/stale_samples_processed"] == 7 + 2
    assert m["fully_async/count/stale_trajectory_processed"] == 11 + 4
    assert m["fully_async/count/current_param_version"] == 5
    assert m["fully_async/partial/total_partial_num"] == 3
    assert m["fully_async/partial/partial_ratio"] == 0.5
    assert m["fully_async/partial/max_partial_span"] == 3
    # tokens decoded before the trajectory's last version: 3, 3, 4 | 2 | 1, 2, 3
    assert m["fully_async/partial/kept_tokens"] == 3 + 1 + 3
    # oldest lags 0 2 1 3 2 4; token ages by hand (mean of 5 - v over model tokens)
    ages = [0.0, (2 + 2 + 1 + 0) / 4, 1.0, (3 + 1) / 2, 2.0, (4 + 3 + 2 + 1) / 4]
    assert m["fully_async/staleness/oldest_lag_mean"] == pytest.approx(12 / 6)
    assert m["fully_async/staleness/oldest_lag_max"] == 4
    assert m["fully_async/staleness/token_age_mean"] == pytest.approx(sum(ages) / 6)
    assert m["fully_async/staleness/token_age_max"] == pytest.approx(2.5)


def test_token_mean_age_and_down_weighting():
    """Bound 1 version. A partial trajectory [1, 4, 4, 4] at version 5: oldest lag 4, token age
    (4 + 1 + 1 + 1) / 4 = 1.75. By oldest lag it is dropped; by token age it is 0.75 over the
    bound: dropped, or weighted 0.5 ** 0.75 when down-weighting."""
    versions = [1, 4, -1, 4, 4]
    by_oldest = version_info(versions, 1, 4, 5, bound=StalenessBound(1))
    assert by_oldest.oldest_lag == 4 and by_oldest.age == 4.0 and by_oldest.drop and by_oldest.weight == 0.0
    by_tokens = version_info(versions, 1, 4, 5, bound=StalenessBound(1, age="token_mean"))
    assert by_tokens.token_age == pytest.approx(1.75) and by_tokens.drop
    soft = version_info(versions, 1, 4, 5, bound=StalenessBound(1, age="token_mean", policy="downweight", decay=0.5))
    assert not soft.drop and soft.weight == pytest.approx(0.5 ** 0.75)
    soft_oldest = version_info(versions, 1, 4, 5, bound=StalenessBound(1, policy="downweight", decay=0.8))
    assert soft_oldest.weight == pytest.approx(0.8 ** 3)
    fresh = version_info([4, 5], 4, 5, 5, bound=StalenessBound(1, age="token_mean", policy="downweight"))
    assert fresh.weight == 1.0 and fresh.token_age == pytest.approx(0.5)
    unbounded = version_info(versions, 1, 4, 5, bound=StalenessBound(None, policy="downweight"))
    assert unbounded.weight == 1.0 and not unbounded.drop
    with pytest.raises(ValueError):
        StalenessBound(1, age="newest")
    with pytest.raises(ValueError):
        StalenessBound(1, decay=0.0)


def test_partial_metrics_agree_with_verl_start_end_rule():
    """verl: diff = |end - start| per trajectory; equal to the token span when the wire invariants hold."""
    consistent = [t for t in BATCH if any(v >= 0 for v in t.weight_versions)]
    diffs = [abs(t.version_end - t.version_start) for t in consistent]
    m = batch_version_metrics(consistent, CURRENT)
    assert m["fully_async/partial/total_partial_num"] == len(diffs) - diffs.count(0)
    assert m["fully_async/partial/partial_ratio"] == (len(diffs) - diffs.count(0)) / len(diffs)
    assert m["fully_async/partial/max_partial_span"] == max(diffs)


def test_empty_batch_and_helpers():
    m = batch_version_metrics([], 3)
    assert (
        m["fully_async/partial/partial_ratio"] == 0.0
        and m["fully_async/partial/max_partial_span"] == 0.0
    )
    assert model_version_range([-1, 7, 6, -1], 0, 0) == (6, 7)
    assert [max_version_lag(s) for s in (0.0, 0.3, 1.0, 1.5)] == [0, 1, 1, 2]
    assert max_version_lag(0.5, slack=1) == 2
    with pytest.raises(ValueError):
        max_version_lag(-0.1)
