"""The engine pool's health checks (issue 50 item 5: out of the pool).

Every ``HEALTH_INTERVAL_S`` each engine must answer ``/model_info`` within
``HEALTH_TIMEOUT_S`` — a hung or stopped server fails that at once, even while a slower
generation probe is still waited for — and then generate (``/health_generate``, timeout above
SGLang's own 20 s). While the rollout is paused for a weight sync (``serving.paused``) engines are
paused on purpose and ``/health_generate`` would wait behind the pause and answer 503, so the
probe is then only ``/model_info``. An engine that fails goes ``unhealthy`` (its calls in
flight stop waiting: :meth:`~rollout_service.engines.handle.EngineHandle.set_state`); one that
answers again goes ``healthy`` and the pool is told (``on_recovered``: calls waiting for a
routable engine look again). Each check also reads the engine's weight version and, at its
first check or after it was unhealthy, its SGLang release (``/server_info``: sampling masks).
A quarantined engine is checked too but only a release puts it back (the pool's business).
The same read judges the engine's launch flags against the run (``requirements``,
:mod:`rollout_service.engines.fitness`): an unfit engine fails its checks with the reason, read
again at each check until it is fit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import EngineError
from asyncrl.sync_control.layout import parse_version
from rollout_service.engines.fitness import EngineRequirements
from rollout_service.engines.handle import EngineHandle
from rollout_service.serving import ServingState

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0  # probe period; an engine that comes back is used again within this
HEALTH_TIMEOUT_S = 5.0  # liveness (/model_info) while paused
HEALTH_GENERATE_TIMEOUT_S = 30.0  # above SGLang's HEALTH_CHECK_TIMEOUT (20 s), after which it answers 503 itself


class HealthChecker:
    """Checks the pool's ``engines`` (the pool's own dict, read at each check) against what the
    rollout serves (``serving``); ``on_recovered`` is called when an engine is healthy again."""

    def __init__(self, engines: dict[str, EngineHandle], serving: ServingState, on_recovered: Callable[[], None],
                 requirements: EngineRequirements | None = None) -> None:
        self.engines, self.serving, self.on_recovered = engines, serving, on_recovered
        self.requirements = requirements or EngineRequirements()

    async def check_once(self) -> None:
        """Check every engine once (concurrently)."""
        await asyncio.gather(*(self._check(h) for h in list(self.engines.values())))

    async def _probe(self, handle: EngineHandle) -> str | None:
        """None if the engine is fit to serve, else why not. A server that does not answer
        ``/model_info`` within ``HEALTH_TIMEOUT_S`` (hung, stopped, gone) fails at once, also
        while a slow ``/health_generate`` is waited for (asked again every
        ``HEALTH_INTERVAL_S``); one that answers must also generate (``/health_generate``),
        except while the rollout is paused for a sync (module docstring)."""
        c = handle.client
        why = await liveness_problem(c)
        if why is not None or self.serving.paused:
            return why
        gen = asyncio.ensure_future(c.health_generate(timeout_s=HEALTH_GENERATE_TIMEOUT_S))
        try:
            while True:
                await asyncio.wait({gen}, timeout=HEALTH_INTERVAL_S)
                if gen.done():
                    break
                why = await liveness_problem(c)
                if why is not None:
                    return why
        finally:
            if not gen.done():
                gen.cancel()
                await asyncio.gather(gen, return_exceptions=True)
        ok = not gen.cancelled() and gen.exception() is None and gen.result()
        return None if ok or self.serving.paused else "health check failed"  # a pause that began meanwhile explains a slow answer

    async def _check(self, handle: EngineHandle) -> None:
        handle.last_checked = time.time()
        handle.account(time.monotonic(), self.serving.version)
        why = await self._probe(handle)
        ok = why is None
        if ok:
            try:
                await self._read_version(handle)
            except EngineError:
                ok, why = False, "no weight version"
        if ok and (handle.release is None or handle.state == "unhealthy"):
            await self._read_server_info(handle)
        if ok and handle.unfit:
            ok, why = False, handle.unfit
        if ok and handle.state == "unhealthy":
            handle.set_state("healthy", None)
            handle.consecutive_failures = 0
            log.info("engine %s healthy again", handle.id)
            self.on_recovered()
        elif not ok and handle.state == "healthy":
            handle.set_state("unhealthy", why)
            log.warning("engine %s failed its health check (%s): %d calls in flight on it go elsewhere",
                        handle.id, why, handle.inflight)

    async def refresh_versions(self, engine_ids: list[str] | None = None) -> None:
        """Ask engines (all, or ``engine_ids``) for their weight version now, each within
        ``HEALTH_TIMEOUT_S``; one that does not answer keeps what it showed. Called after a
        sync (resume, release) so the status shows what the sync wrote at once, not after the
        next answer or health check (which can wait up to ``HEALTH_GENERATE_TIMEOUT_S`` on a
        busy engine)."""
        async def one(handle: EngineHandle) -> None:
            try:
                await self._read_version(handle)
            except EngineError as exc:
                log.debug("engine %s: weight version not read after a sync: %s", handle.id, exc)

        handles = [h for eid, h in list(self.engines.items()) if engine_ids is None or eid in engine_ids]
        await asyncio.gather(*(one(h) for h in handles))

    async def serves(self, version: int) -> tuple[bool | None, list[int | None]]:
        """Whether some engine serves ``version`` or a newer one, asking every engine at once
        (each within ``HEALTH_TIMEOUT_S``) and returning as soon as one says so: a hung engine
        is not waited for once another answered. ``(True, ...)``; ``(False, answers)`` when every
        engine answered an older version (or none); ``(None, [])`` when none answered."""
        tasks = [asyncio.create_task(self._read_version(h)) for h in list(self.engines.values())]
        answers: list[int | None] = []
        try:
            for next_answer in asyncio.as_completed(tasks):
                try:
                    got = await next_answer
                except EngineError:
                    continue
                answers.append(got)
                if got is not None and got >= version:
                    return True, answers
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return (False, answers) if answers else (None, [])

    @staticmethod
    async def _read_version(handle: EngineHandle) -> int | None:
        """Ask the engine for its weight version (``HEALTH_TIMEOUT_S``), record and return the
        answer; raises EngineError when it does not answer."""
        asked_at = time.monotonic()
        version = await handle.client.weight_version(timeout_s=HEALTH_TIMEOUT_S)
        handle.observe_version(version, asked_at)
        return version

    async def _read_server_info(self, handle: EngineHandle) -> None:
        """Record the engine's release from ``/server_info`` (None when it does not say) and
        whether its flags can serve the run (``handle.unfit``)."""
        try:
            info = await handle.client.server_info(timeout_s=HEALTH_TIMEOUT_S)
        except EngineError as exc:
            log.debug("engine %s: release not read: %s", handle.id, exc)
            return
        info = info if isinstance(info, dict) else {}
        handle.release = parse_version(info.get("version"))
        unfit = self.requirements.problem(info)
        if unfit and unfit != handle.unfit:
            log.error("engine %s (%s) cannot serve this run: %s", handle.id, handle.url, unfit)
        handle.unfit = unfit

    async def loop(self, stop: asyncio.Event) -> None:
        """Check every ``HEALTH_INTERVAL_S`` until ``stop`` is set."""
        while not stop.is_set():
            await self.check_once()
            try:
                await asyncio.wait_for(stop.wait(), HEALTH_INTERVAL_S)
            except TimeoutError:
                pass


async def liveness_problem(c: EngineClient) -> str | None:
    """None when the engine answers ``/model_info`` within ``HEALTH_TIMEOUT_S``, else why not
    (``not answering``, with the error when there is one)."""
    try:
        return None if await c.alive(timeout_s=HEALTH_TIMEOUT_S) else "not answering"
    except EngineError as exc:
        return f"not answering: {exc}"
