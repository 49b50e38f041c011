"""Assembling whole groups (all ``n`` trajectories of one prompt) into training batches.

A trajectory arrives on its own (``rollout.publish_unit=trajectory``) or with its group; the
trainer trains whole groups only, because GRPO's advantage is relative to the group.

Rules (deterministic functions of the stream's content and order, so a restarted trainer
that replays the same messages builds the same batches):

- A group accepts members up to its release point ``first_seq + patience + 1``; it is
  *complete* when it holds ``group_size`` distinct trajectory ids (the first member's
  ``group_size``: a later member claiming a larger one cannot hold the group open) (``ready_seq`` = the
  completing member's sequence). A member of the same ``group_id`` arriving after completion
  or after the release point starts a new group.
- A group still incomplete once the stream reached its release point is *released* incomplete
  (``ready_seq`` = the release point): a member that never comes (lost upstream, or poison)
  must not pin the stream cursor forever. Counted as ``incomplete_groups``.
- Groups and their members are therefore functions of the stream alone, and the groups ready
  once the stream was read up to ``D`` are exactly those with ``ready_seq <= D``: taking them
  in ``ready_seq`` order gives the same sequence however the reads were chunked.
- ``take(k, ...)`` returns the ``k`` ready groups with the smallest ``(ready_seq, first_seq)``.
  Staleness is judged there, against the trainer's version at that moment, by the run's
  :class:`~trainer_daemon.algo.StalenessBound`: a trajectory older than ``max_lag`` versions
  (by its oldest token, or its mean token age) is dropped, or kept with a weight < 1
  (``PendingGroup.weights``) when the bound down-weights (``algo.version_info``); a group left
  empty does not count towards ``k``.
- Untrainable members are set aside there too (``exclude(traj)`` names a reason, e.g. an
  infrastructure failure, ``trainer_daemon.consume.exclusion``): they go to ``excluded`` with
  their reason. The group trains the members left (their advantages are relative to each
  other; one member left gets advantage 0); a group left with none is ``empty``.

Not covered: reweighting stale trajectories instead of dropping them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.wire import Trajectory
from trainer_daemon.algo import StalenessBound, version_info


@dataclass
class Held:
    """One delivered, decoded, not yet resolved trajectory."""

    seq: int
    traj: Trajectory
    payload: bytes


@dataclass
class _Group:
    group_id: str
    size: int
    first_seq: int
    release_seq: int
    members: dict[str, Held] = field(default_factory=dict)
    complete_seq: int | None = None


@dataclass
class PendingGroup:
    """A taken group: the trajectories to train and its stale members (resolved together)."""

    kept: list[Held]
    dropped: list[Held] = field(default_factory=list)
    incomplete: bool = False
    excluded: list[tuple[Held, str]] = field(default_factory=list)
    """Members set aside as untrainable, with the reason (module docstring)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Loss weight of kept members older than the bound (down-weighting); absent = 1."""

    @property
    def unused(self) -> list[Held]:
        """Members resolved without training: too stale, or excluded."""
        return self.dropped + [h for h, _ in self.excluded]


@dataclass
class Taken:
    """The result of :meth:`GroupAssembler.take`: groups to train, and groups whose members
    were all too stale (nothing to train; resolve them at once)."""

    groups: list[PendingGroup] = field(default_factory=list)
    empty: list[PendingGroup] = field(default_factory=list)


class GroupAssembler:
    """Holds trajectories by group until whole groups can be taken (module docstring)."""

    def __init__(self, patience: int) -> None:
        if patience < 1:
            raise ValueError("patience must be >= 1")
        self.patience = patience
        self._open: dict[str, _Group] = {}  # accepting members
        self._sealed: list[_Group] = []  # complete or past their release point, not taken yet

    def __len__(self) -> int:
        return sum(len(g.members) for g in self._groups())

    def _groups(self) -> list[_Group]:
        return self._sealed + list(self._open.values())

    def add(self, item: Held) -> None:
        t = item.traj
        g = self._open.get(t.group_id)
        if g is not None and (g.complete_seq is not None or item.seq > g.release_seq):
            self._sealed.append(self._open.pop(t.group_id))  # a late member starts a new group
            g = None
        if g is None:
            g = self._open[t.group_id] = _Group(t.group_id, t.group_size, item.seq, item.seq + self.patience + 1)
        g.members.setdefault(t.id, item)  # the size stays the first member's (a later claim cannot stall the group)
        if g.complete_seq is None and len(g.members) >= g.size:
            g.complete_seq = item.seq

    @staticmethod
    def _ready_seq(g: _Group, max_delivered: int) -> int | None:
        """The sequence at which ``g`` became ready (a function of the stream alone), or None."""
        if g.complete_seq is not None:
            return g.complete_seq
        return g.release_seq if max_delivered >= g.release_seq else None

    def num_ready(self, max_delivered: int) -> int:
        return sum(self._ready_seq(g, max_delivered) is not None for g in self._groups())

    def take(self, k: int, max_delivered: int, version: int, bound: StalenessBound | None,
             effective: Callable[[int], int] = lambda v: v, exclude: Callable[[Trajectory], str] = lambda t: "") -> Taken:
        """Up to ``k`` non-empty ready groups (oldest first); groups whose members were all too stale come back in ``empty``."""
        ready = []
        for g in self._groups():
            rs = self._ready_seq(g, max_delivered)
            if rs is not None:
                ready.append((rs, g.first_seq, g))
        ready.sort(key=lambda r: (r[0], r[1]))
        out = Taken()
        for _, _, g in ready:
            if len(out.groups) >= k:
                break
            if self._open.get(g.group_id) is g:
                del self._open[g.group_id]
            else:
                self._sealed.remove(g)
            pg = PendingGroup(kept=[], incomplete=g.complete_seq is None)
            for h in sorted(g.members.values(), key=lambda h: (h.traj.group_index, h.seq)):
                reason = exclude(h.traj)
                if reason:
                    pg.excluded.append((h, reason))
                    continue
                info = version_info(h.traj.weight_versions, h.traj.version_start, h.traj.version_end, version,
                                    effective=effective, bound=bound)
                (pg.dropped if info.drop else pg.kept).append(h)
                if not info.drop and info.weight < 1.0:
                    pg.weights[h.traj.id] = info.weight
            (out.groups if pg.kept else out.empty).append(pg)
        return out
