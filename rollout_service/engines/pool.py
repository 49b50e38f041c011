"""The rollout service's engines: routing, health and quarantine.

Routing: a trajectory stays on the engine that served its previous turn (its prefix is in
that engine's cache) while that engine is healthy; otherwise it goes to the healthy engine
with the fewest requests in flight from this service. An engine is:

- ``healthy``: routable;
- ``unhealthy``: failed its health check or ``UNHEALTHY_AFTER`` consecutive requests; it is
  probed every ``HEALTH_INTERVAL_S`` and becomes healthy again when it answers;
- ``quarantined``: taken out of rotation by the sync agent (it may hold a mix of two weight
  versions); only an explicit release puts it back.

Engines can be added and removed at run time. Removing an engine aborts this service's
requests on it (they come back with their partial tokens and continue elsewhere).

Aborts are by exact rid: SGLang's tokenizer ignores a rid it does not track exactly, so a
prefix aborts nothing. The pool records every rid it has in flight on each engine and
:meth:`EnginePool.abort_inflight` aborts each matching one by name. A request still on the wire
(or waiting at a paused engine's gate) is not yet known to the engine: the abort misses it,
so a caller that must stop everything re-sends (the runner's pause does, every
``PAUSE_REABORT_S``). Rids are ``<prefix><trajectory id>.t<turn>.s<segment>`` with fixed-length
ids, so no live rid is a prefix of another (SGLang's scheduler matches by prefix).

Health: while the rollout is paused for a weight sync (``paused()``), engines are paused on
purpose and SGLang's ``/health`` (a one-token generation) would wait behind the pause for up
to 20 s and answer 503; the probe is then only "does the server answer" (``/model_info``).
Otherwise it is ``/health_generate`` with a timeout above SGLang's 20 s.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import EngineError, EngineHTTPError, EngineUnavailable
from asyncrl.engine_client.types import GenerateResult

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0  # probe period; an engine that comes back is used again within this
HEALTH_TIMEOUT_S = 5.0  # liveness (/model_info) while paused
HEALTH_GENERATE_TIMEOUT_S = 30.0  # above SGLang's HEALTH_CHECK_TIMEOUT (20 s), after which it answers 503 itself
UNHEALTHY_AFTER = 2  # consecutive connection failures before an engine stops receiving traffic
NO_ENGINE_WAIT_S = 30.0  # a generate call waits this long for some engine to become routable


class NoEngineAvailable(EngineError):
    """No healthy engine to route to."""


@dataclass
class EngineHandle:
    id: str
    url: str
    client: EngineClient
    state: str = "healthy"
    reason: str | None = None
    rids: set[str] = field(default_factory=set)
    """This service's requests in flight on the engine (exact rids, for aborts)."""
    routed: int = 0
    """Generate calls sent to this engine (counted when sent)."""
    served: int = 0
    consecutive_failures: int = 0
    weight_version: str | None = None
    last_checked: float = 0.0
    tokens_decoded: int = 0

    @property
    def inflight(self) -> int:
        return len(self.rids)

    def snapshot(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "state": self.state, "reason": self.reason, "inflight": self.inflight,
                "routed": self.routed, "served": self.served, "weight_version": self.weight_version, "tokens_decoded": self.tokens_decoded}


def engine_id_for(url: str) -> str:
    """A short stable id for an engine URL."""
    return "e-" + hashlib.sha1(url.encode()).hexdigest()[:8]


@dataclass
class EnginePool:
    api_key: str | None = None
    admin_api_key: str | None = None
    request_timeout_s: float = 600.0
    control_timeout_s: float = 60.0
    engines: dict[str, EngineHandle] = field(default_factory=dict)
    paused: Callable[[], bool] = lambda: False
    """True while the rollout is paused for a weight sync (engines are paused on purpose)."""

    def __post_init__(self) -> None:
        self._changed = asyncio.Event()

    # -- membership ---------------------------------------------------------------------
    def add(self, url: str, engine_id: str | None = None) -> EngineHandle:
        """Add an engine (idempotent by URL); it is routable at once."""
        url = url.rstrip("/")
        for handle in self.engines.values():
            if handle.url == url:
                return handle
        eid = engine_id or engine_id_for(url)
        if eid in self.engines:
            raise ValueError(f"engine id {eid!r} is already used by {self.engines[eid].url}")
        client = EngineClient(url, api_key=self.api_key, admin_api_key=self.admin_api_key, request_timeout_s=self.request_timeout_s,
                              control_timeout_s=self.control_timeout_s)
        handle = EngineHandle(id=eid, url=url, client=client)
        self.engines[eid] = handle
        self._changed.set()
        return handle

    async def remove(self, engine_id: str, abort_inflight: bool = True) -> EngineHandle:
        """Take an engine out; abort this service's requests on it first (each by exact rid:
        they come back with their partial tokens and continue elsewhere), then close."""
        handle = self.engines.pop(engine_id)
        self._changed.set()
        if abort_inflight:
            await self._abort_on(handle, "")
        await handle.client.close()
        return handle

    def set_quarantine(self, engine_id: str, quarantined: bool, reason: str | None = None) -> EngineHandle:
        handle = self.engines[engine_id]
        handle.state = "quarantined" if quarantined else "healthy"
        handle.reason = reason if quarantined else None
        handle.consecutive_failures = 0
        self._changed.set()
        return handle

    async def close(self) -> None:
        for handle in self.engines.values():
            await handle.client.close()

    # -- routing ------------------------------------------------------------------------
    def routable(self) -> list[EngineHandle]:
        return [h for h in self.engines.values() if h.state == "healthy"]

    def pick(self, affinity: str | None) -> EngineHandle:
        candidates = self.routable()
        if not candidates:
            raise NoEngineAvailable("no healthy engine: " + ", ".join(f"{h.id}={h.state}" for h in self.engines.values()))
        if affinity is not None:
            for h in candidates:
                if h.id == affinity:
                    return h
        return min(candidates, key=lambda h: (h.inflight, h.served))

    async def _pick_waiting(self, affinity: str | None) -> EngineHandle:
        deadline = time.monotonic() + NO_ENGINE_WAIT_S
        while True:
            try:
                return self.pick(affinity)
            except NoEngineAvailable:
                if time.monotonic() > deadline:
                    raise
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), 1.0)
                except TimeoutError:
                    pass

    async def generate(self, state, input_ids: list[int], sampling_params: dict, rid: str, extra: dict | None = None) -> GenerateResult:
        """Route one generate call (``state.engine_id`` is the affinity, updated here)."""
        handle = await self._pick_waiting(getattr(state, "engine_id", None))
        handle.rids.add(rid)
        handle.routed += 1
        try:
            res = await handle.client.generate(input_ids, sampling_params, rid=rid, extra=extra)
        except EngineUnavailable:
            self._note_failure(handle, "connection failed")
            raise
        except EngineHTTPError as exc:
            if exc.status >= 500:
                self._note_failure(handle, f"HTTP {exc.status}")
            raise
        finally:
            handle.rids.discard(rid)
        handle.consecutive_failures = 0
        handle.served += 1
        handle.tokens_decoded += res.completion_tokens
        if res.weight_version is not None:
            handle.weight_version = res.weight_version
        if state is not None:
            state.engine_id = handle.id
        return res

    async def generate_stream(self, state, input_ids: list[int], sampling_params: dict, rid: str, extra: dict | None = None):
        """Streaming variant of :meth:`generate`: yields cumulative results."""
        handle = await self._pick_waiting(getattr(state, "engine_id", None))
        handle.rids.add(rid)
        handle.routed += 1
        last = None
        try:
            async for res in handle.client.generate_stream(input_ids, sampling_params, rid=rid, extra=extra):
                last = res
                yield res
        except EngineUnavailable:
            self._note_failure(handle, "connection failed")
            raise
        finally:
            handle.rids.discard(rid)
        handle.consecutive_failures = 0
        handle.served += 1
        if last is not None:
            handle.tokens_decoded += last.completion_tokens
            if last.weight_version is not None:
                handle.weight_version = last.weight_version
        if state is not None:
            state.engine_id = handle.id

    def _note_failure(self, handle: EngineHandle, why: str) -> None:
        handle.consecutive_failures += 1
        if handle.state == "healthy" and handle.consecutive_failures >= UNHEALTHY_AFTER:
            handle.state, handle.reason = "unhealthy", why
            log.warning("engine %s (%s) marked unhealthy: %s", handle.id, handle.url, why)

    async def abort_inflight(self, prefix: str = "") -> None:
        """Abort this service's in-flight requests whose rid starts with ``prefix``, on every
        engine, each by its exact rid (module docstring)."""
        await asyncio.gather(*(self._abort_on(h, prefix) for h in list(self.engines.values())))

    async def _abort_on(self, handle: EngineHandle, prefix: str) -> None:
        rids = [r for r in handle.rids if r.startswith(prefix)]

        async def one(rid: str) -> None:
            try:
                await handle.client.abort(rid=rid, timeout_s=self.control_timeout_s)
            except EngineError as exc:
                log.warning("abort of %s on engine %s failed: %s", rid, handle.id, exc)

        await asyncio.gather(*(one(r) for r in rids))

    # -- health -------------------------------------------------------------------------
    async def check_once(self) -> None:
        await asyncio.gather(*(self._check(h) for h in list(self.engines.values())))

    async def _probe(self, handle: EngineHandle) -> bool:
        c = handle.client
        paused = self.paused()
        try:
            if not paused and await c.health_generate(timeout_s=HEALTH_GENERATE_TIMEOUT_S):
                return True
        except EngineError:
            pass
        if not (paused or self.paused()):  # a pause that began during the probe explains a slow answer
            return False
        try:
            return await c.alive(timeout_s=HEALTH_TIMEOUT_S)
        except EngineError:
            return False

    async def _check(self, handle: EngineHandle) -> None:
        handle.last_checked = time.time()
        ok = await self._probe(handle)
        if ok:
            try:
                handle.weight_version = await handle.client.weight_version(timeout_s=HEALTH_TIMEOUT_S)
            except EngineError:
                ok = False
        if ok and handle.state == "unhealthy":
            handle.state, handle.reason, handle.consecutive_failures = "healthy", None, 0
            log.info("engine %s healthy again", handle.id)
            self._changed.set()
        elif not ok and handle.state == "healthy":
            handle.state, handle.reason = "unhealthy", "health check failed"
            log.warning("engine %s failed its health check", handle.id)

    async def health_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.check_once()
            try:
                await asyncio.wait_for(stop.wait(), HEALTH_INTERVAL_S)
            except TimeoutError:
                pass

    def snapshot(self) -> list[dict[str, Any]]:
        return [h.snapshot() for h in self.engines.values()]
