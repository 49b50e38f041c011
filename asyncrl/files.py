"""Durable file writes: the one helper every component uses to replace a file atomically.

``atomic_write(path, data)`` writes ``data`` to a temporary file in the same directory,
fsyncs it, renames it over ``path`` (``os.replace``: readers see the old or the new file,
never a torn one) and fsyncs the directory so the rename itself survives a power loss.
``atomic_file(path)`` is the same for writers that stream (a file object to write to; on an
exception the temporary file is removed and ``path`` is left as it was).

The temporary file is ``.<name>.<pid>.tmp`` beside ``path``: a crash can leave one behind, so
code that scans a directory ignores (or deletes) ``*.tmp``. Not covered: keeping older
versions (callers that need them rotate themselves), directory renames, concurrent writers
of one path within a process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file whose bytes replace ``path`` atomically and durably when the block ends."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (str: UTF-8) atomically and durably (module docstring)."""
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)
