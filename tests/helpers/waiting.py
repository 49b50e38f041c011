"""Bounded waits for a state, the one way tests wait: never a bare ``sleep`` for a state.

``wait_for`` (async) and ``wait_for_sync`` (threads, subprocess tests) poll ``predicate()``
until it returns something truthy and return that value. They fail with an
``AssertionError`` naming ``what`` was awaited once ``timeout_s`` passes (with the log
tails of ``procs``), or at once when one of ``procs`` (:class:`asyncrl.launch.ChildProcess`
or ``subprocess.Popen``) exits meanwhile. An exception from ``predicate`` fails the wait
unless its type is in ``retry_on`` (e.g. ``OSError`` for a server that is not listening
yet); the last such exception is named in the timeout message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from asyncrl.launch import log_tail

WAIT_S = 30.0  # the default bound: every awaited state of a unit-sized test holds within this on a busy 2-core box
ASYNC_INTERVAL_S = 0.05
SYNC_INTERVAL_S = 0.2


def _check_procs(procs: Iterable[Any], what: str) -> None:
    for p in procs:
        code = p.poll()
        if code is None:
            continue
        if hasattr(p, "failure"):
            raise p.failure(f"exited while waiting for {what}")
        raise AssertionError(f"{getattr(p, 'args', p)!r} exited with code {code} while waiting for {what}")


def _timeout(what: str, timeout_s: float, last_error: BaseException | None, procs: list[Any]) -> AssertionError:
    msg = f"timed out after {timeout_s:g} s waiting for {what}"
    if last_error is not None:
        msg += f" (last error: {type(last_error).__name__}: {last_error})"
    for p in procs:
        if getattr(p, "log_path", None) is not None:
            msg += f"\n--- last log lines of {p.name} ({p.log_path}) ---\n{log_tail(p.log_path, 2000)}"
    return AssertionError(msg)


async def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, *, interval_s: float = ASYNC_INTERVAL_S,
                   procs: Iterable[Any] = (), retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Await ``predicate()`` (sync or async) until truthy; return its value (module doc)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    procs = list(procs)
    last_error: BaseException | None = None
    while True:
        _check_procs(procs, what)
        try:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
        except retry_on as exc:
            value, last_error = None, exc
        if value:
            return value
        if loop.time() > deadline:
            raise _timeout(what, timeout_s, last_error, procs)
        await asyncio.sleep(interval_s)


def wait_for_sync(predicate: Callable[[], Any], timeout_s: float, what: str, *, interval_s: float = SYNC_INTERVAL_S,
                  procs: Iterable[Any] = (), retry_on: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``predicate()`` until truthy, blocking this thread; return its value (module doc)."""
    deadline = time.monotonic() + timeout_s
    procs = list(procs)
    last_error: BaseException | None = None
    while True:
        _check_procs(procs, what)
        try:
            value = predicate()
        except retry_on as exc:
            value, last_error = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timeout(what, timeout_s, last_error, procs)
        time.sleep(interval_s)
