"""The staleness quota keeps verl's bound across versions (property test on the counters)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_service.runner.quota import StalenessQuota

# An operation is one of: start (if allowed), finish an in-flight sample, trainer consumes a
# queued one, version update.
ops = st.lists(st.sampled_from(["start", "start", "start", "finish", "consume", "version"]), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ops=ops, max_required=st.integers(1, 20), max_queue=st.integers(1, 30))
def test_samples_started_per_version_never_exceed_the_bound(ops, max_required, max_queue):
    q = StalenessQuota(max_required_samples=max_required, max_queue_size=max_queue)
    in_flight = queued = 0
    version = 0
    for op in ops:
        if op == "start" and q.can_start(queued):
            assert queued < max_queue, "admitted a sample with the queue full"
            q.on_start()
            in_flight += 1
        elif op == "finish" and in_flight:
            in_flight -= 1
            queued += 1
        elif op == "consume" and queued:
            queued -= 1
        elif op == "version":
            version += 1
            q.on_version(version, in_flight, queued)
            assert q.staleness_samples == in_flight + queued
        # verl's rollout_num: new samples this version <= max_required - stale carried over
        assert q.started_this_version <= max(0, max_required - q.carried_over_at_reset)
        assert q.staleness_samples == q.carried_over_at_reset + q.started_this_version
        # a full queue blocks admission (samples already in flight may still finish into it)
        if queued >= max_queue:
            assert not q.can_start(queued)


def test_verl_example_numbers():
    # mini 2, require 1, trigger 2, staleness 0.5 → max_required = floor(4 * 1.5) = 6
    q = StalenessQuota(max_required_samples=6, max_queue_size=6)
    started = 0
    while q.can_start(queued_samples=0):
        q.on_start()
        started += 1
    assert started == 6 and "staleness quota used" in q.blocked_reason(0)
    q.on_version(1, in_flight_samples=1, queued_samples=1)  # 2 stale carried over
    started = 0
    while q.can_start(queued_samples=0):
        q.on_start()
        started += 1
    assert started == 4


def test_queue_bound_blocks_admission():
    q = StalenessQuota(max_required_samples=10, max_queue_size=3)
    assert q.can_start(2) and not q.can_start(3)
    assert "queue full" in q.blocked_reason(3)


def test_version_is_idempotent_and_monotonic():
    q = StalenessQuota(max_required_samples=4, max_queue_size=4)
    q.on_start()
    q.on_version(2, 1, 0)
    q.on_start()
    q.on_version(2, 5, 5)  # repeating the current version changes nothing
    assert q.staleness_samples == 2 and q.version == 2
    with pytest.raises(ValueError, match="backwards"):
        q.on_version(1, 0, 0)


def test_state_round_trip():
    q = StalenessQuota(max_required_samples=4, max_queue_size=4)
    q.on_start()
    q.on_version(3, 1, 1)
    q2 = StalenessQuota(max_required_samples=4, max_queue_size=4)
    q2.load_state_dict(q.state_dict())
    assert q2.snapshot(0) == q.snapshot(0)


def test_a_trainer_starving_past_the_grace_gets_its_shortfall_credited():
    """Issue 65: the trainer dropped a whole step's groups as too stale (restarted behind the
    rollout): nothing in flight or queued, the trainer holding less than a step, the quota used
    up. A moment of that state is every run's (the sync's pause is on its way): only when it
    lasts ``grace_s`` does the watch fire, and the credit reopens the quota; a full queue still
    blocks."""
    from rollout_service.runner.quota import StarvationWatch

    q = StalenessQuota(max_required_samples=2, max_queue_size=4)
    q.on_start()
    q.on_start()
    assert "staleness quota used" in q.blocked_reason(0)
    watch = StarvationWatch(grace_s=30.0)
    assert not watch.observe(True, 100.0) and not watch.observe(True, 129.9)  # the sync's pause may still come
    assert not watch.observe(False, 130.0)  # it came: the watch starts again
    assert not watch.observe(True, 131.0) and watch.observe(True, 161.0)
    assert not watch.observe(True, 162.0)  # fired once; it watches again from here
    q.credit(2)
    assert q.blocked_reason(0) is None and q.staleness_samples == 0
    assert "queue full" in q.blocked_reason(4)
    q.credit(5)
    assert q.staleness_samples == 0  # never below zero
