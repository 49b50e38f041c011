"""A small pool of worker processes running math-verify with a hard wall-clock timeout.

Why processes: math-verify's own timeouts use ``signal.alarm``, which only works in the
main thread, and cannot interrupt long C-level work (sympy big-integer powers, deep
recursion). Here each check runs in a worker subprocess; the calling thread waits on its
pipe for at most ``timeout_s`` and, past it, SIGKILLs the worker and starts a fresh one in
the background. A hung or crashed check therefore costs one worker restart (about 1.5 s of
CPU for the imports) and cannot affect later checks.

Contracts:

- :meth:`VerifyPool.verify` is blocking and thread-safe; it returns a
  :class:`VerifyOutcome` and never raises for any input strings. Its latency is the wait
  for a free worker plus at most ``timeout_s`` (plus a worker start when none is warm).
  :meth:`VerifyPool.averify` is the same on a private thread pool, never blocking the loop.
- Workers are plain ``python -c`` subprocesses (not ``multiprocessing``: no dependence on
  the parent's ``__main__`` guard, start method or threads). Requests and replies are
  length-prefixed JSON frames on the worker's stdin/stdout; nothing is unpickled.
- Each worker runs with ``RLIMIT_AS`` of ``max_memory_mb``, ignores SIGINT, and exits when
  its stdin closes (so it never outlives the parent's pipe).
- Inside a worker, math-verify's signal timeouts serve as a *soft* limit
  (``soft_timeout_s``, whole seconds; the worker runs in its main thread) to avoid restarts
  for interruptible slow cases.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .verify_worker import read_frame, write_frame

logger = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding rollout_service/


@dataclass(frozen=True, slots=True)
class VerifyOutcome:
    """``status``: ``ok`` (the check ran; see ``correct``, ``pred_parsed``,
    ``gold_parsed``, ``soft_timeout``), ``timeout`` (worker killed), ``crashed`` (worker died, e.g. out of
    memory) or ``error`` (the pool could not run the check, e.g. closed)."""

    status: str
    correct: bool = False
    soft_timeout: bool = False  # math-verify's in-worker timeout fired (result is False/unparsed)
    pred_parsed: bool = False
    gold_parsed: bool = False
    elapsed_ms: float = 0.0
    error: str = ""


_BOOT = "import sys; from rollout_service.rewards.verify_worker import main; main(int(sys.argv[1]), int(sys.argv[2]) or None)"


class _Worker:
    """One ``python -c`` subprocess (no multiprocessing: independent of the parent's
    ``__main__`` and start method)."""

    def __init__(self, max_memory_mb: int, soft_timeout_s: int | None, startup_timeout_s: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(max_memory_mb), str(soft_timeout_s or 0)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        try:
            read_frame(self.proc.stdout.fileno(), time.monotonic() + startup_timeout_s)
        except (TimeoutError, EOFError, OSError, ValueError) as exc:
            self.kill()
            raise RuntimeError(f"math-verify worker did not start within {startup_timeout_s}s: {exc!r}") from None

    def request(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The reply, or None past ``timeout_s``; EOFError/OSError when the worker died."""
        write_frame(self.proc.stdin.fileno(), payload)
        try:
            return read_frame(self.proc.stdout.fileno(), time.monotonic() + timeout_s, max_bytes=1 << 16)
        except TimeoutError:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _kill_all(live: set[_Worker]) -> None:
    # Only kill the processes: a thread blocked in ``poll`` then wakes with EOF and cleans up.
    for w in list(live):
        if w.proc.poll() is None:
            w.proc.kill()
    live.clear()


class VerifyPool:
    """``workers`` math-verify processes, started lazily (or by :meth:`start`)."""

    def __init__(
        self,
        workers: int = 2,
        *,
        timeout_s: float = 5.0,
        soft_timeout_s: int | None = None,
        max_memory_mb: int = 1024,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError("need workers >= 1 and timeout_s > 0")
        self.timeout_s = timeout_s
        self.soft_timeout_s = soft_timeout_s if soft_timeout_s is not None else (int(timeout_s / 2) or None)
        self._max_memory_mb = max_memory_mb
        self._startup_timeout_s = startup_timeout_s
        # LIFO: warm workers are reused first; a None slot (not started) only when all are busy.
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # None: a slot whose worker is not started yet
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._next_id = 0
        self.workers = workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="math-verify")
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _kill_all, self._live)

    def _spawn(self) -> _Worker:
        worker = _Worker(self._max_memory_mb, self.soft_timeout_s, self._startup_timeout_s)
        with self._lock:
            if self._closed:
                worker.kill()
                raise RuntimeError("pool closed")
            self._live.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
            self.restarts += 1
        worker.kill()
        threading.Thread(target=self._refill, daemon=True, name="math-verify-respawn").start()

    def _refill(self) -> None:
        try:
            self._idle.put(self._spawn())
        except Exception as exc:
            logger.warning("math-verify worker restart failed: %s", exc)
            self._idle.put(None)

    def start(self) -> None:
        """Start every worker now (blocking, ~1.5 s each, in parallel)."""
        slots = [self._idle.get() for _ in range(self.workers)]
        try:
            slots = list(self._threads.map(lambda s: s or self._spawn(), slots))
        finally:
            for s in slots:
                self._idle.put(s)

    def verify(self, pred: str, golds: list[str], timeout_s: float | None = None) -> VerifyOutcome:
        """Is LaTeX ``pred`` equivalent to any LaTeX in ``golds``? (See the module doc.)"""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._closed:
            return VerifyOutcome("error", error="pool closed")
        slot = self._idle.get()
        try:
            worker = slot or self._spawn()
        except Exception as exc:
            self._idle.put(None)
            return VerifyOutcome("error", error=f"worker start failed: {exc}")
        with self._lock:
            self._next_id += 1
            req_id = self._next_id
        payload = {"id": req_id, "pred": pred, "golds": list(golds)}
        t0 = time.perf_counter()
        try:
            reply = worker.request(payload, timeout_s)
        except (EOFError, OSError, ValueError, TypeError) as exc:
            self._discard(worker)
            return VerifyOutcome("crashed", elapsed_ms=(time.perf_counter() - t0) * 1e3, error=type(exc).__name__)
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        if reply is None or reply.get("id") != req_id:
            self._discard(worker)
            return VerifyOutcome("timeout", elapsed_ms=elapsed_ms, error=f"no answer within {timeout_s}s")
        if "error" in reply:  # e.g. MemoryError: restart so no state leaks into later checks
            self._discard(worker)
            return VerifyOutcome("crashed", elapsed_ms=elapsed_ms, error=str(reply["error"]))
        self._idle.put(worker)
        return VerifyOutcome(
            "ok", correct=bool(reply["correct"]), pred_parsed=bool(reply["pred_parsed"]),
            gold_parsed=bool(reply["gold_parsed"]), soft_timeout=bool(reply.get("soft_timeout")),
            elapsed_ms=elapsed_ms,
        )

    async def averify(self, pred: str, golds: list[str], timeout_s: float | None = None) -> VerifyOutcome:
        """:meth:`verify` on the pool's own threads; safe from any event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.verify, pred, golds, timeout_s)

    def close(self) -> None:
        """Kill the workers; later calls return ``status="error"``. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> VerifyPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
