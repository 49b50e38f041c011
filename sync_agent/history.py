"""The sync history on disk: every finished sync and every refused request, one JSON line each,
in ``<run dir>/sync/history.jsonl``, for as long as an operator may need to find the failure
that started a stall (``/v1/syncs`` and the state file keep only the last 50 syncs, minutes
at two syncs a second).

Bounded (``asyncrl.jsonl_log.BoundedJsonl``): past ``sync.history_max_bytes`` the file becomes
``history.jsonl.1`` and a new one starts, so the history takes at most twice that on disk and
always holds at least the last ``history_max_bytes`` of events. Lines:

- ``{"time", "event": "finished", ...}`` with the sync's public record (id, version, state,
  error, per-engine outcome, phase durations, bytes);
- ``{"time", "event": "refused", "code", "message", "version"}`` for a request answered 409/503.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from asyncrl.jsonl_log import BoundedJsonl

FILE = "history.jsonl"


class SyncHistory:
    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.log = BoundedJsonl(Path(directory) / FILE, max_bytes)
        self.path = self.log.path

    def append(self, event: str, **fields: Any) -> None:
        self.log.append({"time": time.time(), "event": event, **fields})

    def read(self) -> list[dict[str, Any]]:
        return self.log.read()
