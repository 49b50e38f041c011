"""Build a model directory once per cache, safely across processes.

``build_once(out, build)`` returns ``out`` when it holds a ``COMPLETE`` marker; otherwise it
takes an exclusive file lock next to it (so concurrent processes, e.g. test workers or two
``asyncrl up`` runs, build it once), checks again, and calls ``build(out)``, which must write
the directory atomically with ``COMPLETE`` last (``trainer_daemon.sft.save_hf`` does).
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable
from pathlib import Path

MARKER = "COMPLETE"


def build_once(out: Path, build: Callable[[Path], None]) -> Path:
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / MARKER).is_file():
            build(out)
    if not (out / MARKER).is_file():
        raise RuntimeError(f"building {out} finished without its {MARKER} marker")
    return out
