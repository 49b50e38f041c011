"""Which dataset row each group plays, and how far the driver got: :class:`GroupPlan`, :class:`Progress`.

Order: group ``g`` plays row ``order(epoch)[g mod rows]`` of epoch ``g // rows``, where an
epoch's order is the rows in dataset order, or with ``shuffle`` the permutation
``random.Random(seed * 2**32 + epoch).shuffle(range(rows))`` (the rule of the rollout
service's own prompt stream, so both sources shuffle alike). ``total`` is
``rows * total_epochs``, capped at ``total_groups`` when given.

Progress (``progress.json`` in the driver's state directory, replaced atomically): ``started``
is the next group to start; it is saved once a group's first session is open, before its
episodes run. A driver that restarts (crash, service restart) continues at ``started``: a
group whose episodes were cut off is not replayed (its members that finished are published;
the others are finished as failures, below, and the trainer trains the rest of the group).
``finished``, ``failed`` (episodes finished with a ``failure``), ``errors`` (groups the
driver itself failed to play: a bug or a refused request, in its log) and ``done`` (all
groups played) are reported by the service's ``/admin/status``. ``open_sessions`` (id ->
session token) are the sessions opened and not yet finished: a restarted driver finishes
them as ``agent_crash`` first, so their groups are released at once instead of when they
expire. A progress file of another environment, dataset size, order or n is refused rather
than silently continued.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from asyncrl.files import atomic_write


@dataclass(frozen=True)
class GroupPlan:
    rows: int
    total_epochs: int = 1
    shuffle: bool = True
    seed: int = 0
    total_groups: int | None = None

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError("the environment's dataset has no rows")

    @property
    def total(self) -> int:
        full = self.rows * self.total_epochs
        return full if self.total_groups is None else min(full, self.total_groups)

    def order(self, epoch: int) -> list[int]:
        rows = list(range(self.rows))
        if self.shuffle:
            random.Random(self.seed * 2**32 + epoch).shuffle(rows)
        return rows

    def row(self, group: int) -> int:
        if not 0 <= group < self.total:
            raise IndexError(f"group {group} is outside the plan (0..{self.total - 1})")
        epoch, pos = divmod(group, self.rows)
        return self.order(epoch)[pos]

    def key(self) -> str:
        """What a progress file must match to be continued."""
        return f"rows={self.rows} epochs={self.total_epochs} shuffle={self.shuffle} seed={self.seed} total={self.total_groups}"


@dataclass
class Progress:
    env_id: str
    plan_key: str
    n: int
    total: int
    started: int = 0
    finished: int = 0
    failed: int = 0
    errors: int = 0
    done: bool = False
    open_sessions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load_or_new(cls, path: Path, env_id: str, plan: GroupPlan, n: int) -> "Progress":
        if not path.is_file():
            return cls(env_id=env_id, plan_key=plan.key(), n=n, total=plan.total)
        prev = cls(**json.loads(path.read_text()))
        mine = (env_id, plan.key(), n)
        if (prev.env_id, prev.plan_key, prev.n) != mine:
            raise ValueError(f"{path} belongs to another plan ({prev.env_id}, {prev.plan_key}, n={prev.n}), not "
                             f"({env_id}, {plan.key()}, n={n}): use a new run dir, or delete it to start over")
        return prev

    @classmethod
    def read(cls, path: Path) -> "Progress | None":
        """The last saved progress, or None (none yet, or unreadable mid-replace: never torn, see atomic_write)."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(asdict(self)))
