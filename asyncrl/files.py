"""Durable file writes: the one helper every component uses to replace a file atomically.

``atomic_write(path, data)`` writes ``data`` to a temporary file in the same directory,
fsyncs it, renames it over ``path`` (``os.replace``: readers see the old or the new file,
never a torn one) and fsyncs the directory so the rename itself survives a power loss.
Not covered: keeping older versions (callers that need them rotate themselves).
"""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
