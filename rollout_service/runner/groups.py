"""The runner's book of open samples (groups): how many members each still waits for, how many
sessions joined an outside group, and how many members of a sample were cancelled for
staleness (issue 68 item 1: out of the runner, which keeps admission, launch and finish).

- A sample is **open** from its admission (``group_size`` members to finish) until its last
  member finished or left (:meth:`member_finished`, :meth:`member_left`); the runner then
  releases the group's held trajectories (``publish_unit = group``) and forgets it.
- An outside group (sessions) counts the sessions admitted to it: no more than its size
  (:meth:`join`; issue 67 L4).
- A sample whose every member was cancelled for staleness never trains (:meth:`cancelled`):
  the runner gives its place in the staleness quota back.

State only; no I/O. One event loop.
"""

from __future__ import annotations


class GroupBook:
    def __init__(self, n: int) -> None:
        self.n = n
        """``rollout.n``: the size of the service's own groups."""
        self.left: dict[str, int] = {}
        """Open group id → members not finished yet."""
        self._joined: dict[str, int] = {}
        self._cancelled_left: dict[str, int] = {}

    # -- open and close -------------------------------------------------------------------
    def restore(self, left: dict[str, int]) -> None:
        self.left.update(left)

    def open(self, group_id: str, size: int, *, session: bool = False) -> None:
        self.left[group_id] = size
        if session:
            self._joined[group_id] = 1

    def member_finished(self, group_id: str) -> bool:
        """One member of ``group_id`` finished; True when none is left (call :meth:`forget`
        once its trajectories are released)."""
        left = self.left.get(group_id, 1) - 1
        self.left[group_id] = left
        return left <= 0

    def member_left(self, group_id: str) -> bool | None:
        """A member ended without a trajectory: the group waits for one less. None when the
        group is not open; else whether none is left (then forgotten already)."""
        if group_id not in self.left:
            return None
        self.left[group_id] -= 1
        if self.left[group_id] > 0:
            return False
        self.forget(group_id)
        return True

    def forget(self, group_id: str) -> None:
        if self.left.get(group_id, 0) <= 0:
            self.left.pop(group_id, None)
            self._joined.pop(group_id, None)

    # -- sessions ------------------------------------------------------------------------
    def join(self, group_id: str, size: int, recorded_members: int = 0) -> bool:
        """A session joins the open outside group ``group_id``: False when ``size`` sessions
        already did (``recorded_members``: those on record, when this process did not admit
        them itself, after a restart)."""
        joined = self._joined.get(group_id, recorded_members)
        if joined >= size:
            return False
        self._joined[group_id] = joined + 1
        return True

    # -- staleness cancellations ---------------------------------------------------------
    def cancelled(self, group_id: str, group_size: int) -> bool:
        """One member was cancelled for staleness; True once every member of its sample was."""
        left = self._cancelled_left.get(group_id, group_size) - 1
        if left > 0:
            self._cancelled_left[group_id] = left
            return False
        self._cancelled_left.pop(group_id, None)
        return True

    # -- counts ---------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Open samples with a member still to finish."""
        return sum(1 for left in self.left.values() if left > 0)

    def finished_members_waiting(self) -> int:
        """Finished members of the service's own groups whose mates still decode (they are
        trained with their group, not before it)."""
        return sum(self.n - left for left in self.left.values() if 0 < left < self.n)
