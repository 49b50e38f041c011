"""What the sync agent remembers, and where: sync records and the agent's durable state.

``SyncRecord`` is one sync's life: its phase, the duration of every phase, bytes moved, the
per-engine outcome and the error (its public form is :class:`asyncrl.wire.sync.SyncStatus`).
It keeps the request's typed parts (:class:`PlannedGroup`, :class:`~asyncrl.wire.sync.BucketSpec`,
:class:`~asyncrl.wire.sync.ReloadSpec`) and dumps them only to persist; an adapter sync has no
group and no buckets, and keeps its adapter's name and path (not its tensors) and its members.
What must survive a restart of the agent — the current weight version, the weight-update
group the engines are in (address, port, members and their rank offsets), the engines that
must be reloaded before they serve again, and the last records, including one still in
progress — is written atomically (``asyncrl.files.atomic_write``) to
``<run dir>/sync/state.json`` after every phase change, so a restarted agent knows whether it
died mid-sync and can reconcile.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.files import atomic_write
from asyncrl.wire.rollout_admin import PauseOutcome
from asyncrl.wire.sync import (
    ADAPTER_NAME,
    SYNC_FINAL,
    BucketSpec,
    GroupSpec,
    ReloadSpec,
    SyncStatus,
)

KEEP_RECORDS = 50  # syncs kept in the state file and in /status


class PlannedGroup(GroupSpec):
    """The request's group as the agent planned it: the world and every member's rank offset."""

    world_size: int
    members: dict[str, int]
    """engine id → rank offset."""
    urls: dict[str, str]
    """engine id → URL, as the rollout service listed the live engines."""


class AdapterRef(BaseModel):
    """An adapter sync's adapter as the agent keeps it: its name on the engines, the path they
    can read it from (``sync.adapter_transport = path``) and its tensor bytes; never the tensors,
    which the agent holds in memory only for the sync (docs/architecture.md, "Adapters")."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=ADAPTER_NAME)
    path: str | None = None
    nbytes: int = Field(0, ge=0)


@dataclass
class SyncRecord:
    version: int
    group: PlannedGroup | None
    """None for an adapter sync (no weight-update group)."""
    buckets: list[BucketSpec]
    reload: ReloadSpec | None = None
    adapter: AdapterRef | None = None
    """An adapter sync's adapter (its tensors are not persisted)."""
    urls: dict[str, str] = field(default_factory=dict)
    """An adapter sync's members: engine id → URL (a weight sync's are ``group.urls``)."""
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
    pause_outcome: PauseOutcome | None = None
    """What the rollout service's ``per_request`` pause decided for this sync (None: another policy)."""

    def enter(self, phase: str) -> None:
        now = time.time()
        self.phase_seconds[self.state] = self.phase_seconds.get(self.state, 0.0) + now - self.phase_started_at
        self.state, self.phase_started_at = phase, now
        if phase in SYNC_FINAL:
            self.finished_at = now

    @property
    def done(self) -> bool:
        return self.state in SYNC_FINAL

    @property
    def member_urls(self) -> dict[str, str]:
        """Engine id → URL of every member of this sync."""
        return self.group.urls if self.group is not None else self.urls

    @property
    def gb_per_s(self) -> float | None:
        secs = self.phase_seconds.get("loading")
        return self.bytes / 1e9 / secs if secs else None

    def public(self) -> dict[str, Any]:
        """The record as ``GET /v1/syncs/{id}`` answers it (a SyncStatus)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name in SyncStatus.model_fields and f.name not in ("buckets", "gb_per_s")}
        return SyncStatus(**out, buckets=len(self.buckets), gb_per_s=self.gb_per_s).model_dump()

    def to_json(self) -> dict[str, Any]:
        """The record as the state file keeps it."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(group=self.group.model_dump() if self.group is not None else None, buckets=[b.model_dump() for b in self.buckets],
                   reload=self.reload.model_dump() if self.reload else None,
                   adapter=self.adapter.model_dump() if self.adapter else None,
                   pause_outcome=self.pause_outcome.model_dump() if self.pause_outcome else None)
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SyncRecord:
        known = {k: v for k, v in doc.items() if k in _RECORD_FIELDS}
        known.update(group=PlannedGroup.model_validate(doc["group"]) if doc.get("group") else None,
                     buckets=[BucketSpec.model_validate(b) for b in doc.get("buckets", [])],
                     reload=ReloadSpec.model_validate(doc["reload"]) if doc.get("reload") else None,
                     adapter=AdapterRef.model_validate(doc["adapter"]) if doc.get("adapter") else None,
                   pause_outcome=PauseOutcome.model_validate(doc["pause_outcome"]) if doc.get("pause_outcome") else None)
        return cls(**known)


_RECORD_FIELDS = {f.name for f in fields(SyncRecord)}


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


@dataclass
class AgentState:
    """What the agent persists (module docstring)."""

    version: int = 0
    group: GroupInfo | None = None
    records: list[SyncRecord] = field(default_factory=list)
    needs_reload: set[str] = field(default_factory=set)
    """Engines that may hold mixed weights: quarantined until reloaded from disk."""


class StateFile:
    """The agent's durable state (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> AgentState:
        if not self.path.is_file():
            return AgentState()
        doc = json.loads(self.path.read_text())
        return AgentState(version=int(doc.get("version", 0)),
                          group=GroupInfo(**doc["group"]) if doc.get("group") else None,
                          records=[SyncRecord.from_json(r) for r in doc.get("records", [])],
                          needs_reload=set(doc.get("needs_reload", [])))

    def save(self, state: AgentState) -> None:
        doc = {"version": state.version, "group": asdict(state.group) if state.group else None,
               "records": [r.to_json() for r in state.records[-KEEP_RECORDS:]], "needs_reload": sorted(state.needs_reload)}
        atomic_write(self.path, json.dumps(doc))
