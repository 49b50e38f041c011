"""One ``asyncrl up`` per run directory at a time.

A second ``asyncrl up`` on a directory in use would move the live run aside (``<dir>.prev``)
under its running services. So ``asyncrl up`` holds an exclusive ``flock`` on
``<parent>/.<name>.up.lock`` (beside the directory, so the move aside leaves it in place) for
as long as it runs; the kernel releases it when the process ends, however it ends (a SIGKILL
too), so a stale file never blocks a later run. The file holds the holder's pid, for the error.

Limits: advisory, between ``asyncrl up`` processes on hosts that share the lock (``flock`` on
NFS is per host); services started by hand on the same directory are not covered.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class RunDirInUse(RuntimeError):
    """Another ``asyncrl up`` holds the run directory (the message names it and the fix)."""


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.up.lock"


def hold_run_dir(run_dir: Path) -> IO[str]:
    """Take the run directory's lock (keep the returned file open while the run lives), or
    raise :class:`RunDirInUse`."""
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - held open for the run's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise RunDirInUse(f"run directory {run_dir} is in use by another asyncrl up or demo-stack (pid {holder}): stop "
                          f"that run, or give this one a directory of its own (run.dir=<path>)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
