"""The training ledger: which trajectory ids each committed step trained, dropped or skipped,
kept along the lineage of complete checkpoints — the audit trail of exactly-once consumption.

Rank 0 records one entry per committed step (and one for messages resolved between steps).
With each checkpoint it writes the entries since the previous checkpoint of its lineage as a
*segment*, ``<checkpoints>/ledger/step-<N>.json`` = ``{"step": N, "parent": P | null,
"entries": [...]}``, atomically and before the checkpoint is marked complete. Segments are
never pruned with old checkpoints (a few dozen bytes per trajectory).

:func:`read_lineage` follows ``parent`` links back from a complete checkpoint: the result is
exactly what the model of that checkpoint was trained on. Segments of checkpoints that never
completed (a crash in between) are not on any lineage and are ignored; a later timeline that
reaches the same step overwrites them.

Entry shape: ``{"step": int, "version": int, "trained": [id], "dropped": [id],
"duplicate": [id], "poison": [seq], "dlq": [seq], "end": [seq], "seqs": {"trained": [seq], "dropped": [seq],
"duplicate": [seq]}, "generated_by": [[version_start, version_end]]}`` (empty lists omitted;
``seqs`` gives the stream sequence of each id, in the same order; ``generated_by`` the weight
versions that generated each trained trajectory, in the same order; ``dlq``: the sequences of
the dead-letter copies the trainer published). With the stream, this is what ``asyncrl audit
RUN_DIR`` reconciles (``trainer_daemon/audit.py``).

**Lost steps.** Each committed entry is also appended to ``<checkpoints>/ledger/journal.jsonl``
(flushed and fsynced with the step; with or without periodic checkpoints: ``asyncrl audit`` of a
live run accounts by it for the messages purged since the last checkpoint), and the journal is cut back to the entries after a
checkpoint once that checkpoint is complete (:meth:`Ledger.trim_journal`), so it holds at most
the steps since the last complete checkpoint. With periodic checkpoints, a trainer restarted after a crash finds there the
steps trained after its checkpoint and lost with the crash (:func:`lost_steps`); the first
entry of its new segment records them as ``{"lost_steps": [{"step", "version", "trained",
"seqs"}], "between_steps": true}`` — off the lineage's count of trained trajectories (their
data is trained again), on the record for an audit.

**Finished.** A trainer that ends its run (the data ended, or its total steps reached; not a
signalled stop) writes ``<checkpoints>/ledger/finished.json`` = ``{"step", "reason"}`` once its
final checkpoint is complete; a starting trainer removes it. A run whose data ended and whose
end audit found messages unaccounted for adds ``"problem"``: a trainer started on that
checkpoint then refuses (exit 1, the same message) instead of ending the run again, so a
restart policy does not loop on it; remove the file to start it anyway. The audit holds a finished run to
"nothing unconsumed at the end" (``trainer_daemon/audit.py``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from asyncrl.files import atomic_write

LEDGER_DIR = "ledger"
JOURNAL = "journal.jsonl"
FINISHED = "finished.json"
FINISH_REASONS = ("data_ended", "total_steps")
KINDS = ("trained", "dropped", "duplicate", "poison", "dlq", "end")
ID_KINDS = ("trained", "dropped", "duplicate")  # recorded as ids, with their sequences in "seqs"


def segment_path(root: Path, step: int) -> Path:
    return Path(root) / LEDGER_DIR / f"step-{step:08d}.json"


class Ledger:
    """Entries since the last checkpoint of this lineage (rank 0)."""

    def __init__(self, parent: int | None = None, journal: Path | None = None, root: Path | None = None) -> None:
        self.parent = parent
        self.journal = journal
        self.root = root
        """The checkpoints directory, where the segment of ``parent`` lies (to amend it: :meth:`snapshot`)."""
        self.entries: list[dict[str, Any]] = []
        self._last: dict[str, Any] | None = None  # the newest segment this ledger wrote
        self._loose: dict[str, list] = {k: [] for k in KINDS}
        self._loose_seqs: dict[str, list[int]] = {k: [] for k in ID_KINDS}

    def note(self, kind: str, value: str | int, seq: int | None = None) -> None:
        """A message resolved outside a step (dropped, duplicate: an id and its ``seq``; poison,
        dlq: a sequence) before the next commit."""
        self._loose[kind].append(value)
        if kind in ID_KINDS:
            self._loose_seqs[kind].append(-1 if seq is None else int(seq))

    def record_lost(self, lost: list[dict[str, Any]]) -> None:
        """Steps trained after the restored checkpoint and lost with a crash (module docstring)."""
        if lost:
            self.entries.append({"step": self.parent or 0, "version": -1, "trained": [], "between_steps": True,
                                 "lost_steps": [{k: e[k] for k in ("step", "version", "trained", "seqs") if k in e} for e in lost]})

    def commit(self, step: int, version: int, trained: list[str], trained_seqs: list[int] | None = None,
               generated_by: list[tuple[int, int]] | None = None) -> None:
        """The entry of committed step ``step`` (takes the loose notes with it)."""
        entry: dict[str, Any] = {"step": step, "version": version, "trained": list(trained)}
        if trained and generated_by is not None:
            entry["generated_by"] = [[int(a), int(b)] for a, b in generated_by]
        entry.update({k: v for k, v in self._loose.items() if v and k != "trained"})
        seqs = {k: v for k, v in self._loose_seqs.items() if v and k != "trained"}
        if trained:
            seqs["trained"] = list(trained_seqs) if trained_seqs is not None else [-1] * len(trained)
        if seqs:
            entry["seqs"] = seqs
        self.entries.append(entry)
        self._loose = {k: [] for k in KINDS}
        self._loose_seqs = {k: [] for k in ID_KINDS}
        if self.journal is not None and trained:
            self.journal.parent.mkdir(parents=True, exist_ok=True)
            with self.journal.open("a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())

    @property
    def unsaved(self) -> bool:
        """Something was committed or resolved since the last snapshot: a checkpoint taken now
        would record it (the run's end checkpoints again when so: ``daemon._finish``)."""
        return bool(self.entries) or any(self._loose.values())

    def trim_journal(self, checkpoint_step: int) -> None:
        """Checkpoint ``checkpoint_step`` is complete (its segment holds the recorded lost steps):
        keep only the journal's later steps."""
        if self.journal is None or not self.journal.is_file():
            return
        keep = [e for e in _read_journal(self.journal) if not e.get("lost") and e["step"] > checkpoint_step]
        atomic_write(self.journal, "".join(json.dumps(e) + "\n" for e in keep))

    def adopt_lost(self, lost: list[dict[str, Any]]) -> None:
        """At a restart: record ``lost`` (:func:`lost_steps`) in this segment and mark them lost in
        the journal, so a second crash before the next checkpoint still finds them, once."""
        self.record_lost(lost)
        if self.journal is not None and self.journal.parent.is_dir():
            atomic_write(self.journal, "".join(json.dumps(e | {"lost": True}) + "\n" for e in lost))

    def snapshot(self, step: int, version: int) -> dict[str, Any]:
        """The segment of a checkpoint at ``step``; starts a new segment whose parent is ``step``."""
        if any(self._loose.values()):
            self.commit(step, version, [])
            self.entries[-1]["between_steps"] = True
        if step == self.parent and self.parent is not None:
            # a second checkpoint of the same step (the run's end, after messages were resolved
            # between steps): the step's segment again, with the entries since (same parent)
            last = self._last or json.loads(segment_path(self.root, step).read_text())
            segment = {"step": step, "parent": last["parent"], "entries": [*last["entries"], *self.entries]}
        else:
            segment = {"step": step, "parent": self.parent, "entries": self.entries}
        self._last = segment
        self.parent, self.entries = step, []
        return segment


def _read_journal(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line cut by the crash: everything before it was fsynced whole
    return out


def lost_steps(root: Path, restored_step: int) -> list[dict[str, Any]]:
    """Journal entries of steps after ``restored_step`` (trained, then lost with a crash), and
    those an earlier restart marked lost that no complete checkpoint has recorded yet."""
    path = Path(root) / LEDGER_DIR / JOURNAL
    if not path.is_file():
        return []
    return [{k: v for k, v in e.items() if k != "lost"} for e in _read_journal(path) if e.get("lost") or e["step"] > restored_step]


def write_segment(root: Path, segment: dict[str, Any]) -> Path:
    """Write a segment atomically and durably (``asyncrl.files.atomic_write``)."""
    path = segment_path(root, int(segment["step"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(segment))
    return path


def read_lineage(root: Path, step: int) -> list[dict[str, Any]]:
    """All entries of the lineage ending at checkpoint ``step``, oldest first."""
    chain: list[list[dict[str, Any]]] = []
    current: int | None = step
    seen: set[int] = set()
    while current is not None:
        if current in seen:
            raise ValueError(f"ledger parent cycle at step {current}")
        seen.add(current)
        segment = json.loads(segment_path(root, current).read_text())
        chain.append(segment["entries"])
        current = segment["parent"]
    return [e for entries in reversed(chain) for e in entries]


def write_finished(root: Path, step: int, reason: str, problem: str | None = None) -> None:
    """Record that the run ended at checkpoint ``step`` for ``reason`` (module docstring);
    ``problem``: what its end audit found unaccounted for (a trainer started on it refuses)."""
    if reason not in FINISH_REASONS:
        raise ValueError(f"unknown finish reason {reason!r}")
    path = Path(root) / LEDGER_DIR / FINISHED
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"step": step, "reason": reason} | ({"problem": problem} if problem else {})))


def read_finished(root: Path) -> dict[str, Any] | None:
    path = Path(root) / LEDGER_DIR / FINISHED
    return json.loads(path.read_text()) if path.is_file() else None


def clear_finished(root: Path) -> None:
    (Path(root) / LEDGER_DIR / FINISHED).unlink(missing_ok=True)


def ledger_accounts(entries: list[dict[str, Any]]) -> tuple[dict[int, str], Counter]:
    """Sequence → kind (trained, dropped, duplicate, poison, dlq, end), and how often each id was
    trained, along ``entries`` (a lineage, or a journal). Lost steps are not counted: their data
    is trained again."""
    kinds: dict[int, str] = {}
    trained_ids: Counter = Counter()
    for e in entries:
        trained_ids.update(e.get("trained", []))
        for kind in ID_KINDS:
            for seq in e.get("seqs", {}).get(kind, []):
                if seq >= 0:
                    kinds[int(seq)] = kind
        for kind in ("poison", "dlq", "end"):
            for seq in e.get(kind, []):
                kinds[int(seq)] = kind
    return kinds, trained_ids
