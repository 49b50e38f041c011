"""The on-disk outbox: finished trajectories wait here until JetStream acknowledges them.

Every finished trajectory is written here (atomically and fsynced) *before* the service
forgets the agent that produced it, and removed only after a PubAck — so a trajectory
survives a NATS outage and a crash of the service, and ``Nats-Msg-Id`` dedup turns every
republish after a crash into a no-op.

Layout under the outbox directory::

    ready/<seq>-<trajectory id>.traj   to publish, oldest first
    held/g-<hash of group id>/<trajectory id>.traj
                                       finished trajectories of a group still running
                                       (``publish_unit = "group"``); the directory's
                                       ``group-id`` file holds the group id itself
    rejected/<trajectory id>.traj      refused by the server for good (e.g. too large);
                                       kept and counted, never silently dropped
    acked/<stream seq>-<trajectory id>.traj
                                       acknowledged by JetStream, kept ``keep_acked_s``
                                       (``rollout.outbox_keep_acked_s``) in case the server
                                       loses them (a host crash before its fsync, RELIABILITY
                                       F3): :meth:`requeue_acked` puts them back in ``ready``

Identifiers never name a path on their own (issue 30: a session's ``group_id`` of ``..`` made
``/finish`` delete the outbox): a held group's directory is named by a hash of its id, and
every file name built from a trajectory id goes through :func:`asyncrl.files.child_path`
(a plain single component inside its directory, else ``ValueError`` before anything is
written). Held directories of earlier versions, named by the raw id, are renamed at start.

The outbox is bounded by ``max_items`` (ready + held). ``has_room`` turning False is the
runner's signal to stop admitting new work (backpressure). Single-process, single event
loop: the directory must not be shared by two rollout services.

The ``*_async`` writers do the file work (write, fsync, rename, directory fsync: ~2 ms each on
this machine's disk) in worker threads so the event loop keeps serving agents meanwhile, and
concurrent fsyncs share the file system's journal commits; sequence numbers and counts are
taken on the loop's thread (a ready entry counts from before its write: the publisher can
ack it before the writer resumes). They return once the file is durable, like the plain writers
(bench/control_plane.py found the plain ones, on the loop, the first limit at scale).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.files import atomic_write, child_path, hashed_name, is_plain_name
from asyncrl.wire import Trajectory, decode_trajectory, encode_trajectory

_READY_NAME = re.compile(r"^(\d{12})-(.+)\.traj$")
GROUP_ID_FILE = "group-id"  # in a held group's directory: the group id it holds


@dataclass(frozen=True)
class OutboxEntry:
    path: Path
    trajectory_id: str


class Outbox:
    def __init__(self, root: Path | str, max_items: int, keep_acked_s: float = 0.0) -> None:
        self.root = Path(root)
        self.max_items = max_items
        self.keep_acked_s = keep_acked_s
        self.ready_dir = self.root / "ready"
        self.held_dir = self.root / "held"
        self.rejected_dir = self.root / "rejected"
        self.acked_dir = self.root / "acked"
        for d in (self.ready_dir, self.held_dir, self.rejected_dir, self.acked_dir):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.rglob("*.tmp"):
            leftover.unlink()
        self._rename_legacy_held()
        self._next_seq = 1 + max((int(m.group(1)) for p in self.ready_dir.iterdir() if (m := _READY_NAME.match(p.name))), default=0)
        self._count = len(self.ready_entries()) + sum(len(ids) for ids in self.held_ids().values())

    # -- counting -----------------------------------------------------------------------
    def ready_entries(self) -> list[OutboxEntry]:
        """Ready trajectories, oldest first."""
        entries = []
        for p in sorted(self.ready_dir.iterdir()):
            m = _READY_NAME.match(p.name)
            if m:
                entries.append(OutboxEntry(p, m.group(2)))
        return entries

    def held_ids(self) -> dict[str, set[str]]:
        """group id → ids of its finished trajectories waiting for the rest of the group."""
        out = {}
        for g in self.held_dir.iterdir():
            if g.is_dir() and (g / GROUP_ID_FILE).is_file():
                out[(g / GROUP_ID_FILE).read_text()] = {p.stem for p in g.glob("*.traj")}
        return out

    def _group_dir(self, group_id: str) -> Path:
        return child_path(self.held_dir, hashed_name(group_id, "g-"))

    def _held_path(self, traj: Trajectory) -> Path:
        _check_id(traj.id)
        return child_path(self._group_dir(traj.group_id), f"{traj.id}.traj")

    def _rename_legacy_held(self) -> None:
        """Held directories of earlier versions were named by the group id: rename them to the
        hashed name (their trajectories say which group they hold)."""
        for g in list(self.held_dir.iterdir()):
            if not g.is_dir() or (g / GROUP_ID_FILE).is_file():
                continue
            trajs = sorted(g.glob("*.traj"))
            if not trajs:
                shutil.rmtree(g)
                continue
            group_id = decode_trajectory(trajs[0].read_bytes()).group_id
            atomic_write(g / GROUP_ID_FILE, group_id)
            target = self._group_dir(group_id)
            if target != g:
                os.replace(g, target)

    def __len__(self) -> int:
        """Ready + held trajectories (kept in memory; the directory is only scanned at start)."""
        return self._count

    def has_room(self) -> bool:
        return len(self) < self.max_items

    def contains(self, trajectory_id: str) -> bool:
        """True when the trajectory is waiting here (ready or held)."""
        if any(e.trajectory_id == trajectory_id for e in self.ready_entries()):
            return True
        return any(trajectory_id in ids for ids in self.held_ids().values())

    # -- writing ------------------------------------------------------------------------
    def put_ready(self, traj: Trajectory) -> Path:
        """Durably queue a trajectory for publishing."""
        path = self._write_ready(traj)
        self._count += 1
        return path

    def _write_ready(self, traj: Trajectory) -> Path:
        path = self._ready_path(traj.id)
        atomic_write(path, encode_trajectory(traj))
        return path

    def _ready_path(self, trajectory_id: str) -> Path:
        _check_id(trajectory_id)
        path = child_path(self.ready_dir, f"{self._next_seq:012d}-{trajectory_id}.traj")
        self._next_seq += 1
        return path

    async def put_ready_async(self, traj: Trajectory) -> Path:
        """:meth:`put_ready` with the file work in a worker thread. Counted from the start:
        the publisher may see the file, publish and :meth:`ack` it before this returns."""
        path = self._ready_path(traj.id)
        self._count += 1
        try:
            await asyncio.to_thread(atomic_write, path, encode_trajectory(traj))
        except BaseException:
            self._count -= 1
            raise
        return path

    async def hold_async(self, traj: Trajectory) -> Path:
        """:meth:`hold` with the file work in a worker thread."""
        path = self._held_path(traj)
        if await asyncio.to_thread(self._write_held, path, encode_trajectory(traj), traj.group_id):
            self._count += 1
        return path

    @staticmethod
    def _write_held(path: Path, data: bytes, group_id: str) -> bool:
        if not path.parent.is_dir():
            path.parent.mkdir()
        if not (path.parent / GROUP_ID_FILE).is_file():
            atomic_write(path.parent / GROUP_ID_FILE, group_id)
        new = not path.exists()
        atomic_write(path, data)
        return new

    async def release_group_async(self, group_id: str) -> int:
        """:meth:`release_group` with the file work in worker threads."""
        group = self._group_dir(group_id)
        trajs = await asyncio.to_thread(self._read_group, group)
        if trajs is None:
            return 0
        writes = [(self._ready_path(t.id), encode_trajectory(t)) for t in trajs]
        await asyncio.to_thread(self._write_all_then_drop, writes, group)
        return len(trajs)

    @staticmethod
    def _read_group(group: Path) -> list[Trajectory] | None:
        if not group.is_dir():
            return None
        return sorted((decode_trajectory(p.read_bytes()) for p in group.glob("*.traj")), key=lambda t: t.group_index)

    @staticmethod
    def _write_all_then_drop(writes: list[tuple[Path, bytes]], group: Path) -> None:
        for path, data in writes:
            atomic_write(path, data)
        shutil.rmtree(group)

    def hold(self, traj: Trajectory) -> Path:
        """Durably keep a finished trajectory until its group completes."""
        path = self._held_path(traj)
        if self._write_held(path, encode_trajectory(traj), traj.group_id):
            self._count += 1
        return path

    def release_group(self, group_id: str) -> int:
        """Move a completed group's held trajectories to ready (in group-index order)."""
        group = self._group_dir(group_id)
        trajs = self._read_group(group)
        if trajs is None:
            return 0
        self._write_all_then_drop([(self._ready_path(t.id), encode_trajectory(t)) for t in trajs], group)
        return len(trajs)

    # -- after the server answered ----------------------------------------------------------
    def read(self, entry: OutboxEntry) -> bytes:
        return entry.path.read_bytes()

    def written_at(self, entry: OutboxEntry) -> float | None:
        """When the entry was written (its file's mtime, wall clock); None if it is gone."""
        try:
            return entry.path.stat().st_mtime
        except FileNotFoundError:
            return None

    def ack(self, entry: OutboxEntry, seq: int | None = None) -> None:
        """The server stored it (or already had it) at stream sequence ``seq``: out of the queue
        (kept in ``acked/`` for ``keep_acked_s`` when that is > 0 and ``seq`` is known)."""
        if self._ack_file(entry, seq):
            self._count -= 1

    async def ack_many(self, acks: list[tuple[OutboxEntry, int | None]]) -> None:
        """:meth:`ack` for several entries, the file work in one worker-thread call."""
        removed = await asyncio.to_thread(lambda: sum(self._ack_file(entry, seq) for entry, seq in acks))
        self._count -= removed

    def _ack_file(self, entry: OutboxEntry, seq: int | None) -> bool:
        try:
            if self.keep_acked_s > 0 and seq is not None:
                os.replace(entry.path, child_path(self.acked_dir, f"{seq:012d}-{entry.trajectory_id}.traj"))
            else:
                entry.path.unlink()
        except FileNotFoundError:
            return False
        return True

    def prune_acked(self, now: float | None = None) -> int:
        """Drop acknowledged entries older than ``keep_acked_s``; how many were dropped."""
        now = time.time() if now is None else now
        dropped = 0
        for p in self.acked_dir.iterdir():
            try:
                if now - p.stat().st_mtime > self.keep_acked_s:
                    p.unlink()
                    dropped += 1
            except FileNotFoundError:
                pass
        return dropped

    def requeue_acked(self) -> int:
        """Put every kept acknowledged entry back in ``ready`` (oldest first): the server lost
        some of them. Those it still has are answered as duplicates. Returns how many."""
        moved = 0
        for p in sorted(self.acked_dir.iterdir()):
            m = _READY_NAME.match(p.name)
            if not m:
                continue
            os.replace(p, self._ready_path(m.group(2)))
            self._count += 1
            moved += 1
        return moved

    def reject(self, entry: OutboxEntry, reason: str) -> Path:
        """The server refused it for good: keep it aside with the reason, out of the queue."""
        target = child_path(self.rejected_dir, f"{entry.trajectory_id}.traj")
        os.replace(entry.path, target)
        self._count -= 1
        target.with_suffix(".reason").write_text(reason + "\n")
        return target

    def rejected_count(self) -> int:
        return len(list(self.rejected_dir.glob("*.traj")))


def _check_id(trajectory_id: str) -> None:
    """A trajectory id is part of every file name here: it must be a plain name on its own
    (:func:`asyncrl.files.is_plain_name`; the service's ids always are)."""
    if not is_plain_name(trajectory_id):
        raise ValueError(f"trajectory id {trajectory_id!r} is not a plain file name: refused by the outbox")
