"""Resuming a runner from its checkpoints at start (the exactly-once half of a restart).

The runner persists two things in the run's KV buckets: its document (prompt-stream cursor
and staleness-quota counters, :func:`runner_document`) and one checkpoint per live agent
(:class:`~rollout_service.runner.store.AgentStore`). :func:`restore` reads both back:

- the stream and the quota continue where they stopped (a fresh run has no document);
- an agent whose trajectory is already in the outbox finished before the crash, after its
  outbox write and before its checkpoint delete: its checkpoint is deleted and it is
  *dropped* (counted), never re-run;
- every other agent is returned to be resumed from its last checkpoint, and counted as an
  unfinished member of its group;
- groups held in the outbox (``publish_unit = "group"``) none of whose members is still
  running finished completely before the crash: they are released for publishing.

Trajectory ids are deterministic, so anything re-run after an older checkpoint is
deduplicated downstream (``Nats-Msg-Id``). Not covered: checkpoints that cannot be decoded
(the store logs and skips them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_service.agent.state import AgentState


def runner_document(stream, quota) -> dict[str, Any]:
    """What the runner saves in its state bucket (read back by :func:`restore`)."""
    return {"stream": stream.state_dict(), "quota": quota.state_dict()}


@dataclass
class Restored:
    agents: list[AgentState] = field(default_factory=list)
    """Agents to resume, in checkpoint order."""
    groups: dict[str, int] = field(default_factory=dict)
    """Group id → members still to finish (among the agents to resume)."""
    dropped: int = 0
    """Checkpoints whose trajectory was already in the outbox (deleted)."""


async def restore(*, state_store, agent_store, outbox, stream, quota) -> Restored:
    """Load the runner document into ``stream`` and ``quota`` and sort the agent checkpoints
    (see the module docstring)."""
    doc = await state_store.load()
    if doc:
        stream.load_state_dict(doc["stream"])
        quota.load_state_dict(doc["quota"])
    out = Restored()
    for state in await agent_store.load_all():
        if outbox.contains(state.id):
            await agent_store.delete(state.id)
            out.dropped += 1
            continue
        out.agents.append(state)
        out.groups[state.group_id] = out.groups.get(state.group_id, 0) + 1
    for group_id in outbox.held_ids():
        if group_id not in out.groups:  # every member finished before the crash
            outbox.release_group(group_id)
    return out
