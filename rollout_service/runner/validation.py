"""Validation rollouts: the validation set, greedy (``rollout.val_sampling``), scored — and
when they run.

:func:`run_validation` rolls the set out once. :class:`ValidationSchedule` decides when: after
a resume at every ``rollout.test_freq``-th version (in the background, one run at a time; a
version reached while one runs is skipped), once at version 0 when a fresh run starts with
``rollout.val_before_train``, and on demand (``POST /admin/validate``, awaited,
may overlap a background run). It keeps the newest result for ``/admin/status``.

Validation agents run beside training rollouts on the same engines (training is never
stopped for validation); they are not published to the trajectory stream and do not count
against the staleness quota. They obey the pause gate like every agent, so a weight sync
during validation pauses them too (their results then span two versions; reported).

Metric names follow verl: ``val-core/<data_source>/reward/mean@1`` (accuracy for 0/1
rewards), ``val-aux/<data_source>/response_length/mean``, ``val-aux/num_turns/mean``,
``val-aux/num_tool_calls/mean``, plus the versions the rollouts saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence

from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.loop import run_agent
from rollout_service.agent.state import AgentState

Validator = Callable[[int], Awaitable[dict]]


class ValidationSchedule:
    """When validation runs (see the module docstring); no validator: never."""

    def __init__(self, test_freq: int, validator: Validator | None = None) -> None:
        self.test_freq = test_freq
        self.validator = validator
        """The service's when a validation set exists (rollouts + publishing the metrics)."""
        self.last_result: dict | None = None
        self._task: asyncio.Task | None = None

    @property
    def configured(self) -> bool:
        return self.validator is not None

    def on_version(self, version: int) -> asyncio.Task | None:
        """The runner resumed at ``version``: start a background run when it is due."""
        if self.test_freq > 0 and version > 0 and version % self.test_freq == 0:
            return self.start(version)
        return None

    def start(self, version: int) -> asyncio.Task | None:
        """Run in the background (the running task if one is under way; None when not configured)."""
        if self.validator is None:
            return None
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(version), name=f"validation-v{version}")
        return self._task

    async def run(self, version: int) -> dict:
        """Run now and keep the result."""
        if self.validator is None:
            raise RuntimeError("no validation set")
        result = await self.validator(version)
        self.last_result = result
        return result

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _noop_checkpoint(state: AgentState) -> None:
    return None


async def run_validation(records: Sequence, deps: AgentDeps, run_id: str, version: int, concurrency: int) -> dict:
    """Roll out every record once with ``deps`` (greedy sampling) and aggregate metrics."""
    val_deps = dataclasses.replace(deps, checkpoint=_noop_checkpoint, rid_prefix=deps.rid_prefix + "val.")
    limit = asyncio.Semaphore(max(1, concurrency))
    t0 = time.monotonic()

    async def one(i: int, rec) -> AgentState:
        state = AgentState(id=f"v{version}-{i}", run_id=run_id, group_id=f"val-{version}", group_size=1, group_index=0,
                           prompt_id=rec.prompt_id, data_source=rec.data_source, ground_truth=rec.ground_truth,
                           extra_info=dict(rec.extra_info), messages=rec.chat(), created_at=time.time())
        async with limit:
            return await run_agent(state, val_deps)

    states = await asyncio.gather(*(one(i, rec) for i, rec in enumerate(records)))
    by_source: dict[str, list[AgentState]] = defaultdict(list)
    for s in states:
        by_source[s.data_source].append(s)
    metrics: dict[str, float] = {}
    for source, group in sorted(by_source.items()):
        metrics[f"val-core/{source}/reward/mean@1"] = sum(s.reward for s in group) / len(group)
        metrics[f"val-aux/{source}/response_length/mean"] = sum(s.response_length for s in group) / len(group)
    metrics["val-aux/num_turns/mean"] = sum(s.assistant_turns for s in states) / len(states)
    metrics["val-aux/num_tool_calls/mean"] = sum(s.num_tool_calls for s in states) / len(states)
    metrics["val-aux/reward/mean"] = sum(s.reward for s in states) / len(states)
    metrics["val-aux/finished_error"] = sum(s.finish_reason == "error" for s in states)
    seen = [v for s in states for v in (s.version_start, s.version_end) if v is not None]
    return {"kind": "validation", "version": version, "samples": len(states), "seconds": round(time.monotonic() - t0, 3),
            "versions_seen": sorted(set(seen)), "metrics": metrics}
