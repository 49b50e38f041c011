"""asyncrl.task_progress.TaskProgress: a bar on a terminal, a throttled line elsewhere."""

from __future__ import annotations

import io

import pytest

from asyncrl.task_progress import TaskProgress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_stream_gets_a_line_every_interval_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    with TaskProgress("warm-up", total=10, stream=out, every_s=10.0, clock=clock) as bar:
        for _ in range(4):
            clock.now += 3.0
            bar.advance(note="loss 0.5")
    lines = out.getvalue().splitlines()
    # 3, 6, 9 s: nothing; 12 s: the first line (4/10 after 12 s -> 18 s left); then the end line
    assert lines == ["[asyncrl] warm-up: 4/10 (40 %), 12 s elapsed, ~18 s left, loss 0.5",
                     "[asyncrl] warm-up: 4/10 (40 %), 12 s elapsed, ~18 s left, loss 0.5"]


def test_done_line_has_no_time_left_and_minutes_past_90_s():
    clock = Clock()
    bar = TaskProgress("conversion", total=2, stream=io.StringIO(), clock=clock).__enter__()
    clock.now += 100.0
    bar.advance(2)
    assert bar.line() == "[asyncrl] conversion: 2/2 (100 %), 1.7 min elapsed"


def test_terminal_gets_a_live_bar():
    out = Terminal()
    with TaskProgress("warm-up of tiny-arith", total=5, stream=out) as bar:
        for _ in range(3):
            bar.advance(note="loss 0.25")
    text = out.getvalue()
    assert "warm-up of tiny-arith" in text and "3/5" in text and "loss 0.25" in text
    assert "[asyncrl]" not in text  # the bar, not the plain lines


def test_disabled_writes_nothing_and_total_must_be_positive():
    out = Terminal()
    with TaskProgress("x", total=3, stream=out, enabled=False) as bar:
        bar.advance(3)
    assert out.getvalue() == "" and bar.done == 3
    with pytest.raises(ValueError):
        TaskProgress("x", total=0)
