"""asyncrl.progress.ProgressWindow: deltas over a window, idle time, bounded samples."""

import pytest

from asyncrl.progress import SAMPLES_PER_WINDOW, ProgressWindow


def test_deltas_cover_the_window_only():
    w = ProgressWindow(window_s=60)
    for t in range(0, 181, 5):  # a counter growing by 1 per second for 3 minutes
        w.observe({"tokens": t}, now=t)
    assert w.deltas(now=180) == {"tokens": 60}
    assert w.covered_s(now=180) == 60


def test_young_window_covers_the_time_since_the_first_sample():
    w = ProgressWindow(window_s=60)
    w.observe({"tokens": 100}, now=0)
    w.observe({"tokens": 130}, now=10)
    assert w.deltas(now=10) == {"tokens": 30}
    assert w.covered_s(now=10) == 10


def test_current_values_count_without_being_stored():
    w = ProgressWindow(window_s=60)
    w.observe({"a": 1}, now=0)
    assert w.deltas(now=3, current={"a": 4}) == {"a": 3}
    assert w.idle_for("a", now=3, current={"a": 4}) == 0.0
    assert w.deltas(now=3) == {"a": 0}
    assert len(w._samples) == 1


def test_idle_for_counts_from_the_last_growth():
    w = ProgressWindow(window_s=60)
    w.observe({"syncs": 0}, now=0)
    w.observe({"syncs": 1}, now=5)
    for t in range(10, 101, 5):
        w.observe({"syncs": 1}, now=t)
    assert w.idle_for("syncs", now=100) == 95
    assert w.deltas(now=100) == {"syncs": 0}
    assert w.idle_for("never", now=100) is None


def test_a_counter_that_restarts_counts_from_its_new_value():
    w = ProgressWindow(window_s=60)
    w.observe({"published": 50}, now=0)
    w.observe({"published": 3}, now=5)  # the process restarted
    w.observe({"published": 7}, now=10)
    assert w.deltas(now=10) == {"published": 7}


def test_samples_stay_bounded():
    w = ProgressWindow(window_s=12)
    for i in range(10_000):
        w.observe({"x": i}, now=i * w.interval_s)
    assert len(w._samples) <= SAMPLES_PER_WINDOW + 2


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s"):
        ProgressWindow(window_s=0)
