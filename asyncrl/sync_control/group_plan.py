"""Whether the engines of a new weight-update group can form it, judged once for both senders
(issue 68 item 5): the sync agent's coordinator and the trainer's direct publisher.

:func:`plan_group` reads each member's layout (``/server_info``: its ranks, release and flags,
:meth:`~asyncrl.sync_control.engine_update.EngineUpdate.read_layouts`, which sets each member's
rank offset) and refuses, in this order, what cannot work:

- ``nccl_mismatch``: over NCCL, engines whose NCCL or torch versions cannot share a group with
  the trainer's (:func:`~asyncrl.sync_control.layout.check_nccl`);
- ``pause_policy``: engines the run's pause plan cannot pause safely (spans, the in-place
  flags: :func:`~asyncrl.sync_control.pause_policy.policy_problems`);
- ``layout``: a mixture-of-experts update an engine's release cannot load
  (:func:`~asyncrl.sync_control.layout.moe_problems`).

A refusal is :class:`GroupRefused` (its ``code`` one of the above, its message naming each
engine and the fix); a layout that cannot be read raises what ``read_layouts`` raises
(:class:`~asyncrl.sync_control.layout.LayoutError`, or an engine error). Each caller turns it
into its own answer (the agent's 409 with the code, the publisher's sync error).
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl.sync_control.engine_update import EngineUpdate
from asyncrl.sync_control.layout import EngineLayout, check_nccl, moe_problems
from asyncrl.sync_control.pause_policy import PausePlan, policy_problems


class GroupRefused(Exception):
    """The members cannot form the group (module docstring)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


async def plan_group(update: EngineUpdate, plan: PausePlan, names: Sequence[str], *, backend: str,
                     nccl_versions: tuple[str | None, str | None] | None = None) -> tuple[list[EngineLayout], int]:
    """The members' layouts and the group's world size (module docstring). ``names``: the
    parameters the update sends; ``nccl_versions``: the trainer's (NCCL, torch) for ``nccl``."""
    layouts, world = await update.read_layouts()
    if backend == "nccl":
        problems = check_nccl(layouts, *(nccl_versions or (None, None)))
        if problems:
            raise GroupRefused("nccl_mismatch", "NCCL versions cannot form one group: " + "; ".join(problems))
    problems = policy_problems(plan, layouts)
    if problems:
        raise GroupRefused("pause_policy", "; ".join(problems))
    problems = moe_problems(layouts, list(names))
    if problems:
        raise GroupRefused("layout", "; ".join(problems))
    return layouts, world
