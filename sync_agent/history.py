"""The sync history on disk: every finished sync and every refused request, one JSON line each,
in ``<run dir>/sync/history.jsonl``, for as long as an operator may need to find the failure
that started a stall (``/v1/syncs`` and the state file keep only the last 50 syncs, minutes
at two syncs a second).

Bounded: when the file passes ``sync.history_max_bytes`` it becomes ``history.jsonl.1``
(replacing the previous one) and a new file starts, so the history takes at most twice that
on disk and always holds at least the last ``history_max_bytes`` of events. Lines:

- ``{"time", "event": "finished", ...}`` with the sync's public record (id, version, state,
  error, per-engine outcome, phase durations, bytes);
- ``{"time", "event": "refused", "code", "message", "version"}`` for a request answered 409/503.

A write that fails (disk full) is logged and dropped: the history never stops a sync.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE = "history.jsonl"


class SyncHistory:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.path = Path(directory) / FILE
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, event: str, **fields: Any) -> None:
        line = json.dumps({"time": time.time(), "event": event, **fields}, default=str) + "\n"
        try:
            if self.path.is_file() and self.path.stat().st_size + len(line) > self.max_bytes:
                os.replace(self.path, self.path.with_name(FILE + ".1"))
            with self.path.open("a") as f:
                f.write(line)
        except OSError as exc:
            log.warning("sync history not written: %s", exc)

    def read(self) -> list[dict[str, Any]]:
        """Every event kept, oldest first (the rotated file, then the current one)."""
        out = []
        for p in (self.path.with_name(FILE + ".1"), self.path):
            if p.is_file():
                out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        return out
