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

Privacy (issue 48 item 5): what a run writes is its user's alone. The temporary file is
created 0600 whatever the umask; :func:`private_dir` makes a directory 0700 (tightening one
that exists and is ours); :func:`keep_new_files_private` sets the process umask to 077, which
the run-writing commands (``asyncrl rollout``, ``trainer``, ``sync-agent``, ``nats``, ``up``,
``slurm``...) do first, so every file and directory they and their children create (the data
export, trajectories, checkpoints, NATS' store, logs) is 0600/0700. Not covered: files a
deployment's own tools put in the run directory.

``child_path(parent, name)`` is the one way an identifier (a trajectory or group id, which a
client may have chosen) becomes a path: a plain single component or an error;
``hashed_name(id)`` names anything else (the outbox's held groups).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
PRIVATE_UMASK = 0o077


def keep_new_files_private() -> int:
    """Set this process's umask to 077 (its children inherit it); returns the previous one."""
    return os.umask(PRIVATE_UMASK)


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner alone (0600 whatever the umask; a file
    that exists is truncated and tightened), creating its directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, PRIVATE_FILE_MODE)


def private_dir(path: str | Path) -> Path:
    """Create ``path`` (and its parents) with mode 0700, or tighten it to 0700 when it exists,
    is ours and lets group or others in; returns it."""
    path = Path(path)
    path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        path.chmod(PRIVATE_DIR_MODE)
    return path


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file whose bytes replace ``path`` atomically and durably when the block ends."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE), "wb") as f:
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


# An identifier used as one file-name component as it is: letters, digits, ``_ : -`` and dots,
# not starting with a dot (so never ``.``, ``..`` or a hidden file), no separator, <= 200 chars.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_:-][A-Za-z0-9_.:-]{0,199}$")


def is_plain_name(identifier: str) -> bool:
    """Whether ``identifier`` can be a file name as it is (see :func:`hashed_name` otherwise)."""
    return bool(_PLAIN_NAME.match(identifier))


def hashed_name(identifier: str, prefix: str = "h-") -> str:
    """A file-name component for any identifier (``prefix`` + 32 hex digits of its SHA-256):
    whatever a client put in the id, the name is plain and the same id always maps to it."""
    return prefix + hashlib.sha256(identifier.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def child_path(parent: str | Path, name: str) -> Path:
    """``parent / name`` for a single plain component ``name`` (:func:`is_plain_name`); raises
    ``ValueError`` for anything else, and if the result would not lie directly in ``parent``
    (a symlinked ``parent`` is resolved first). Every place an identifier becomes a path goes
    through this: an id can never name a file outside its directory."""
    if not is_plain_name(name):
        raise ValueError(f"{name!r} is not a plain file name")
    base = Path(parent).resolve()
    path = base / name
    if path.parent != base:
        raise ValueError(f"{name!r} leaves {base}")
    return path
