"""What the trainer has consumed from its stream: the part of a checkpoint that makes
consumption exactly-once (RELIABILITY.md §1, "the checkpoint owns the cursor").

Vocabulary (stream sequences of the trajectories subject; the durable consumer delivers
them in increasing order, redeliveries aside):

- *resolved*: the trainer is done with the message: ``trained`` in a committed step,
  ``dropped`` as too stale, ``duplicate`` (its trajectory id was already resolved), or
  ``poison`` (undecodable; terminated and dead-lettered), or ``end`` (the rollout's
  end-of-data message, :mod:`asyncrl.wire.end_of_data`; counted in ``end_of_data``, its
  sequence in ``end_of_data_seq``).
- *held*: delivered and not resolved yet (its group is incomplete, it waits for the next
  step, or the current step trains it).
- ``cursor``: every message with ``seq <= cursor`` is resolved. After each change
  ``cursor = min(held) - 1`` if anything is held, else the highest delivered sequence —
  valid because delivery is in order, so every trajectory message up to the highest delivered
  one has been seen in this incarnation.
- ``above``: ``seq -> (kind, id)`` of resolved messages above the cursor (groups complete out
  of order, so the resolved set is not a prefix).
- ``recent_ids``: ids of the last ``RECENT_IDS`` trained or dropped messages that fell below the
  cursor, to recognise a trajectory republished under a new sequence (after the stream's
  ``Nats-Msg-Id`` window); older ids are forgotten — keep ``nats.duplicate_window_s`` above
  the publisher's retry horizon.

Restart rule: a restored trainer recreates its consumer at ``cursor + 1`` and resolves a
delivered message without training it when its sequence is in ``above`` or its id is known.
Messages held at the checkpoint are not resolved, so they are delivered and trained again.
Hence, along the lineage of committed checkpoints, each message is resolved exactly once.

The state is plain JSON (``state_dict``), written by rank 0 with each checkpoint.
"""

from __future__ import annotations

from collections import deque
from typing import Any

RESOLVED_KINDS = ("trained", "dropped", "duplicate", "poison", "end")
# Only these make an id "known". A duplicate's id is not: its original may still be held
# (unresolved) at a checkpoint and must be trained after a restart.
_ID_KINDS = ("trained", "dropped")
# Ids remembered below the cursor. 16k ids (~0.7 MB of JSON per checkpoint) cover many
# steps of any realistic batch; the stream's publish dedup is the first line of defence.
RECENT_IDS = 16_384
COUNTERS = ("trained", "dropped", "dropped_tokens", "duplicate", "poison", "incomplete_groups", "stale_samples", "stale_trajectories",
            "excluded", "truncated_sampling_trained", "end_of_data", "end_of_data_seq")
# Besides these, ``excluded/<reason>`` counts excluded trajectories per reason (consume/exclusion.py).


class ConsumptionState:
    """Cursor, resolved set, id memory and counters (module docstring)."""

    def __init__(self, recent_ids: int = RECENT_IDS) -> None:
        self.cursor = 0
        self.above: dict[int, tuple[str, str]] = {}
        self.held: set[int] = set()
        self.max_delivered = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._recent: deque[str] = deque(maxlen=recent_ids)
        self._recent_set: set[str] = set()
        self._ids_above: set[str] = set()

    # -- queries ---------------------------------------------------------------------------
    def is_resolved(self, seq: int) -> bool:
        return seq <= self.cursor or seq in self.above

    def knows_id(self, traj_id: str) -> bool:
        """True when a trajectory with this id was already resolved (trained, dropped, duplicate)."""
        return traj_id in self._ids_above or traj_id in self._recent_set

    # -- transitions -----------------------------------------------------------------------
    def delivered(self, seq: int) -> None:
        """Note a delivery (call for every delivered message, before hold/resolve)."""
        if seq > self.max_delivered:
            self.max_delivered = seq

    def hold(self, seq: int) -> None:
        self.held.add(seq)

    def resolve(self, items: list[tuple[int, str, str]]) -> None:
        """Resolve ``(seq, kind, id)`` items (id may be '' for poison), then advance the cursor."""
        for seq, kind, traj_id in items:
            if kind not in RESOLVED_KINDS:
                raise ValueError(f"unknown resolution {kind!r}")
            self.held.discard(seq)
            if seq <= self.cursor or seq in self.above:
                continue
            self.above[seq] = (kind, traj_id)
            if traj_id and kind in _ID_KINDS:
                self._ids_above.add(traj_id)
        self._advance()

    def _advance(self) -> None:
        target = min(self.held) - 1 if self.held else self.max_delivered
        if target <= self.cursor:
            return
        for seq in sorted(s for s in self.above if s <= target):
            kind, traj_id = self.above.pop(seq)
            if traj_id and kind in _ID_KINDS:
                self._ids_above.discard(traj_id)
                self._remember(traj_id)
        self.cursor = target

    def _remember(self, traj_id: str) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(traj_id)
        self._recent_set.add(traj_id)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe snapshot (held messages are deliberately not in it: they are redelivered)."""
        return {
            "cursor": self.cursor,
            "above": [[seq, kind, tid] for seq, (kind, tid) in sorted(self.above.items())],
            "recent_ids": list(self._recent),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.max_delivered = self.cursor
        self.held.clear()
        self.above = {int(seq): (str(kind), str(tid)) for seq, kind, tid in state["above"]}
        self._ids_above = {tid for kind, tid in self.above.values() if tid and kind in _ID_KINDS}
        self._recent.clear()
        self._recent_set.clear()
        for tid in state["recent_ids"]:
            self._remember(str(tid))
        self.counters = dict.fromkeys(COUNTERS, 0) | {k: int(v) for k, v in state["counters"].items()}
