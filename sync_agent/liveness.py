"""Which engines answer, asked without waiting on the ones that do not.

The agent looks at the engines (``/model_info``) at every sync request, every reconcile round
and every push check of an idle trainer. A live engine (SGLang's HTTP process, local_engine's
loop) answers at once; a dead or hung one answers never. :class:`EngineLiveness` asks an
engine it has not heard fail with the full ``LIVENESS_TIMEOUT_S``. An engine that missed
its last probe is *silent*: it is asked again by one background probe at a time (each bounded
by ``RECHECK_TIMEOUT_S``), and a look waits at most ``SILENT_WAIT_S`` for that probe (enough
for a restarted engine, which answers in milliseconds) before counting it down. So after a
member hung mid-sync, the trainer's push check and its sync request cost well under a second
each instead of the recheck bound twice (issue 33: the hung-engine case's ~4 s between the
failed sync and the push that repairs the survivor).

Contract: ``model_info(id, client)`` returns the engine's ``/model_info`` or None (down). An
engine leaves the silent set as soon as one probe answers. Background probes end on their own
within ``RECHECK_TIMEOUT_S``; nothing here outlives that.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import EngineError
from asyncrl.sync_control.engine_update import LIVENESS_TIMEOUT_S

log = logging.getLogger(__name__)

RECHECK_TIMEOUT_S = 2.0  # one background probe of a silent engine
SILENT_WAIT_S = 0.25  # how long a look waits on that probe (a live engine answers in ms)


class EngineLiveness:
    def __init__(self, control_timeout_s: float) -> None:
        self.control_timeout_s = control_timeout_s
        self.silent: set[str] = set()
        """Engines whose last probe went unanswered."""
        self._rechecks: dict[str, asyncio.Task] = {}

    def mark_silent(self, engine_ids: set[str]) -> None:
        """Engines known to be hung or gone (a sync saw them stop): not waited for next time."""
        self.silent |= engine_ids

    async def model_info(self, engine_id: str, client: EngineClient) -> dict[str, Any] | None:
        if engine_id not in self.silent:
            try:
                info = await client.model_info(timeout_s=min(self.control_timeout_s, LIVENESS_TIMEOUT_S))
            except EngineError:
                self.silent.add(engine_id)
                return None
            return info
        task = self._rechecks.get(engine_id)
        if task is None or task.done():
            task = self._rechecks[engine_id] = asyncio.create_task(self._recheck(engine_id, client))
        done, _ = await asyncio.wait({task}, timeout=SILENT_WAIT_S)
        return task.result() if done else None

    async def _recheck(self, engine_id: str, client: EngineClient) -> dict[str, Any] | None:
        try:
            info = await client.model_info(timeout_s=min(self.control_timeout_s, RECHECK_TIMEOUT_S))
        except EngineError as exc:
            log.debug("engine %s still silent: %s", engine_id, exc)
            return None
        self.silent.discard(engine_id)
        return info

    async def close(self) -> None:
        """Stop the background probes (at the agent's shutdown)."""
        tasks = [t for t in self._rechecks.values() if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._rechecks.clear()
