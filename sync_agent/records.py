"""What the sync agent remembers, and where: sync records and the agent's durable state.

``SyncRecord`` is one sync's life: its phase, the duration of every phase, bytes moved, the
per-engine outcome and the error. ``AgentState`` is what must survive a restart of the
agent: the current weight version, the weight-update group the engines are in (address,
port, members) and the last records, including one still in progress. It is written
atomically (tmp + rename) to ``<run dir>/sync/state.json`` after every phase change, so a
restarted agent knows whether it died mid-sync and can reconcile.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("queued", "pausing", "awaiting_broadcast", "loading", "resuming")
TERMINAL = ("succeeded", "failed")
KEEP_RECORDS = 50  # syncs kept in the state file and in /status


@dataclass
class SyncRecord:
    version: int
    group: dict[str, Any]
    buckets: list[dict[str, Any]]
    flattened: bool = True
    reload: dict[str, Any] | None = None
    id: str = field(default_factory=lambda: "sync-" + uuid.uuid4().hex[:12])
    state: str = "queued"
    previous_version: int = 0
    join_group: bool = False
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    phase_started_at: float = field(default_factory=time.time)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    engines: dict[str, str] = field(default_factory=dict)
    resumed_at_version: int | None = None
    error: str | None = None

    def enter(self, phase: str) -> None:
        now = time.time()
        self.phase_seconds[self.state] = self.phase_seconds.get(self.state, 0.0) + now - self.phase_started_at
        self.state, self.phase_started_at = phase, now
        if phase in TERMINAL:
            self.finished_at = now

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def gb_per_s(self) -> float | None:
        secs = self.phase_seconds.get("loading")
        return self.bytes / 1e9 / secs if secs else None

    def public(self, with_buckets: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not with_buckets:
            out["buckets"] = len(self.buckets)
        out["gb_per_s"] = self.gb_per_s
        return out


@dataclass
class GroupInfo:
    master_address: str
    master_port: int
    backend: str
    group_name: str
    world_size: int
    members: dict[str, int]
    """engine id → rank offset."""

    @property
    def key(self) -> tuple[str, int]:
        return (self.master_address, self.master_port)


class StateFile:
    """The agent's durable state (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> tuple[int, GroupInfo | None, list[SyncRecord]]:
        if not self.path.is_file():
            return 0, None, []
        doc = json.loads(self.path.read_text())
        group = GroupInfo(**doc["group"]) if doc.get("group") else None
        records = [SyncRecord(**r) for r in doc.get("records", [])]
        return int(doc.get("version", 0)), group, records

    def save(self, version: int, group: GroupInfo | None, records: list[SyncRecord]) -> None:
        doc = {"version": version, "group": asdict(group) if group else None,
               "records": [asdict(r) for r in records[-KEEP_RECORDS:]]}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)
