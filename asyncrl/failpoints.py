"""Failpoints: named places in the code where a fault test can hold a process, to kill it there.

A fault that must strike inside a short window (a checkpoint's background write, a collective)
cannot be hit reliably by timing a signal. A failpoint makes the window as long as the test
needs: the process stops at :func:`hold` until the test releases it, or kills it there.

Contract (all through files, so it works across ``torchrun`` and any number of processes):

- The environment variable ``ASYNCRL_FAILPOINTS`` names a directory. Unset (production):
  :func:`hold` returns at once, after one environment lookup.
- :func:`hold` ``(name)`` acts only while ``<dir>/<name>.arm`` exists (the test creates it when
  the run has reached the state it wants). Then it writes ``<dir>/<name>.reached.<pid>`` and
  waits until ``<dir>/<name>.release`` exists, at most ``ASYNCRL_FAILPOINT_MAX_S`` seconds
  (default 600; a forgotten failpoint cannot hang a process forever).
- Names are dotted, ``<component>.<place>``; each call site documents its name.

Failpoints in the product: ``checkpoint.write`` (trainer, inside the background write of a
checkpoint, while ``dcp.async_save``'s future is pending); ``trainer.sync_bucket`` (trainer
rank 0, through the sync agent, before broadcasting every bucket after the first: the engines
hold part new, part old weights while it holds; :func:`hold_async`, the event loop runs on);
``trainer.step.<N>`` (trainer, every rank, before training step ``N``: its batch is taken from
the stream, nothing of it committed);
``local_engine.step`` (local_engine, before each scheduler step: generations stop where they
are while HTTP, aborts and pauses are still answered; a pause waits for the step to end);
``rollout.per_request_decided`` (rollout service, in a ``per_request`` pause after every call
in flight was judged and the cancelled ones marked, before the aborts);
``local_engine.lora_partial_load`` (local_engine emulating 0.5.21+, :func:`fires`: an adapter
load fails as if one rank had failed after another loaded it, leaving the name "with an
incomplete unload" until it is unloaded, as SGLang does); ``local_engine.weights_drift``
(local_engine, :func:`fires`: each applied bucket's first parameter is nudged after the copy,
so the engine silently holds weights its peers do not — what ``/weights_checker`` must catch).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

ENV_DIR = "ASYNCRL_FAILPOINTS"
ENV_MAX_S = "ASYNCRL_FAILPOINT_MAX_S"
POLL_S = 0.05


def _armed(name: str) -> tuple[Path, float] | None:
    """When failpoint ``name`` is armed: mark it reached by this process and return the release
    file and the deadline of the wait; else None."""
    root = os.environ.get(ENV_DIR)
    if not root:
        return None
    d = Path(root)
    if not (d / f"{name}.arm").exists():
        return None
    (d / f"{name}.reached.{os.getpid()}").touch()
    return d / f"{name}.release", time.monotonic() + float(os.environ.get(ENV_MAX_S, "600"))


def hold(name: str) -> bool:
    """Stop here while failpoint ``name`` is armed (module docstring); True if it held."""
    armed = _armed(name)
    if armed is None:
        return False
    release, deadline = armed
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return True


async def hold_async(name: str) -> bool:
    """:func:`hold` for a coroutine: the same files, waiting with ``asyncio.sleep``."""
    armed = _armed(name)
    if armed is None:
        return False
    release, deadline = armed
    while not release.exists() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return True


def fires(name: str) -> bool:
    """True while failpoint ``name`` is armed (it is marked reached), without holding: for a
    fault the process injects itself at that place (``local_engine.lora_partial_load``)."""
    return _armed(name) is not None


def reached(root: Path, name: str) -> list[int]:
    """Pids of the processes that reached failpoint ``name`` (for the test's side)."""
    return sorted(int(p.name.rsplit(".", 1)[1]) for p in Path(root).glob(f"{name}.reached.*"))
