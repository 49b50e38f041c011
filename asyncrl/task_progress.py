"""Progress of a long step a user waits for (a warm-up, a model conversion): a live bar on a
terminal, a line every few seconds elsewhere.

    with TaskProgress("warm-up", total=550) as bar:
        for step in ...:
            bar.advance(note=f"loss {loss:.3f}")

On a terminal (``stream.isatty()``) it draws a ``rich`` progress bar with the count, elapsed
time, time left and the last note; otherwise (a log file, a pipe, a container's log) it writes
one plain line at most every ``every_s`` seconds and one at the end:
``[asyncrl] warm-up: 120/420 (29 %), 15 s elapsed, ~38 s left, loss 0.530``.

Contract and limits: one thread drives it; the time left is a linear extrapolation of the
rate so far; nothing is written when ``enabled`` is false.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class TaskProgress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, every_s: float = 10.0,
                 enabled: bool = True, clock=time.monotonic) -> None:
        if total <= 0:
            raise ValueError(f"total must be > 0, got {total}")
        self.label, self.total, self.every_s, self.enabled, self.clock = label, total, every_s, enabled, clock
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self.note = ""
        self._started = self._last_line = 0.0
        self._bar = None
        self._task = None

    def __enter__(self) -> TaskProgress:
        self._started = self._last_line = self.clock()
        if self.enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                 TextColumn("{task.fields[note]}"), console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, note="")
        return self

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + n)
        self.note = note or self.note
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, note=self.note)
            return
        now = self.clock()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            self._line(now)

    def line(self, now: float | None = None) -> str:
        """The plain status line (what a non-terminal stream gets)."""
        now = self.clock() if now is None else now
        elapsed = now - self._started
        text = f"[asyncrl] {self.label}: {self.done}/{self.total} ({100 * self.done / self.total:.0f} %), {_duration(elapsed)} elapsed"
        if 0 < self.done < self.total:
            text += f", ~{_duration(elapsed / self.done * (self.total - self.done))} left"
        return text + (f", {self.note}" if self.note else "")

    def _line(self, now: float) -> None:
        print(self.line(now), file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
        else:
            self._line(self.clock())
