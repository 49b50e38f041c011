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
is not yet known to the engine: the abort misses it. One waiting at a paused engine's gate is
known (SGLang's tokenizer registers it before the gate), but from 0.5.20 the tokenizer passes
one exact-rid abort per request and drops the later ones, and an abort that reaches a request
held at the gate finds it not yet scheduled and is lost. So a caller that must stop everything
re-sends (the runner's partial pause does, every ``pause_modes.PAUSE_REABORT_S``) and, once the re-sends are used
up, aborts everything on the engines still holding its calls. Rids are ``<prefix><trajectory id>.t<turn>.s<segment>`` with fixed-length
ids, so no live rid is a prefix of another (SGLang's scheduler matches by prefix).

Health: :mod:`.health` (``HealthChecker``, which this pool runs); an engine's state and
counters: :mod:`.handle`.

Sampling masks: each engine's release is read from ``/server_info`` at its first health check
(and after it was unhealthy); a call whose truncated sampling has a bounded support asks that
engine for its sampling masks where the release has them
(:func:`asyncrl.engine_client.sampling_mask.asks_sampling_mask`), so the result carries each
token's behaviour log-prob.

Leaving rotation takes the engine's calls back: when an engine becomes unhealthy or is
quarantined, every generate call of this service waiting on it stops waiting (its
``lost`` event), is aborted there by exact rid in the background, and raises
:class:`EngineLost`; the turn loop retries it on another engine, keeping every token of
earlier calls (the lost call's own tokens were never received). Bound: a hung engine's calls
are elsewhere within ``HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S`` (about 7 s) plus one interval
of retry backoff, instead of the call's timeout (:meth:`EnginePool.call_timeout`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import (
    EngineError,
    EngineHTTPError,
    EngineUnavailable,
    PausedWhileRouting,
)
from asyncrl.engine_client.sampling_mask import asks_sampling_mask
from asyncrl.engine_client.types import GenerateResult
from rollout_service.engines.fitness import EngineRequirements
from rollout_service.engines.handle import EngineHandle, engine_id_for
from rollout_service.engines.health import HEALTH_TIMEOUT_S, HealthChecker, liveness_problem
from rollout_service.serving import ServingState

log = logging.getLogger(__name__)

UNHEALTHY_AFTER = 2  # consecutive connection failures before an engine stops receiving traffic
NO_ENGINE_WAIT_S = 30.0  # a generate call waits this long for some engine to become routable
NO_ENGINE_RECHECK_S = 1.0  # a call waiting for a routable engine looks again at least this often (and at every change)


class NoEngineAvailable(EngineError):
    """No healthy engine to route to."""


class EngineLost(EngineError):
    """The engine left rotation (health check failed, quarantined) while a call ran on it."""


@dataclass
class EnginePool:
    api_key: str | None = None
    admin_api_key: str | None = None
    request_timeout_s: float | None = None
    """Fixed bound of one generate call; None: :meth:`call_timeout` derives it per call."""
    request_timeout_floor_s: float = 60.0
    min_decode_tokens_per_s: float = 2.0
    control_timeout_s: float = 60.0
    engines: dict[str, EngineHandle] = field(default_factory=dict)
    serving: ServingState = field(default_factory=ServingState)
    """What the rollout serves now (:mod:`rollout_service.serving`; the runner writes it): while
    it is paused for a weight sync engines are paused on purpose (no health verdicts); while its
    gate holds calls (a ``partial`` or ``hold`` pause, or a ``drain`` pause once its trajectories
    are done) a call still waiting for a routable engine goes back to the gate
    (``PausedWhileRouting``). During a ``drain`` pause the gate is open for the trajectories it
    waits for: their calls keep waiting for an engine here (sent back, they would find the gate
    open and come straight back: a loop that never yields). Its version re-admits an engine back
    from quarantine at it; its adapter route is what every call asks for (``lora_path``) and the
    version that labels the call's tokens."""

    requirements: EngineRequirements = field(default_factory=EngineRequirements)
    """What the run needs of each engine's flags (:mod:`rollout_service.engines.fitness`)."""

    def __post_init__(self) -> None:
        self._changed = asyncio.Event()
        self._background: set[asyncio.Task] = set()  # aborts of lost calls, version reads after a sync
        self.health = HealthChecker(self.engines, self.serving, self._changed.set, self.requirements)

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
        handle = EngineHandle(id=eid, url=url, client=self._client(url))
        self.engines[eid] = handle
        self._changed.set()
        return handle

    async def unreachable(self, url: str) -> str | None:
        """Why an engine at ``url`` cannot join (it does not answer ``/model_info`` within
        ``HEALTH_TIMEOUT_S``: a typo, an engine not started yet), or None. Asked with a client
        of its own before :meth:`add`, so no call is routed to it meanwhile; an engine already
        in the pool is not asked (None)."""
        url = url.rstrip("/")
        if any(h.url == url for h in self.engines.values()):
            return None
        async with self._client(url) as client:
            return await liveness_problem(client)

    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, api_key=self.api_key, admin_api_key=self.admin_api_key,
                            request_timeout_s=self.request_timeout_s or self.request_timeout_floor_s,
                            control_timeout_s=self.control_timeout_s)

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
        handle.set_state("quarantined" if quarantined else "healthy", reason if quarantined else None)
        handle.consecutive_failures = 0
        self._changed.set()
        return handle

    async def close(self) -> None:
        """Stop the background aborts and version reads, then close every engine's client."""
        tasks = [t for t in self._background if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
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
            except NoEngineAvailable as exc:
                if self.serving.holding_calls:
                    raise PausedWhileRouting(f"paused for a sync while waiting for an engine ({exc})") from None
                if time.monotonic() > deadline:
                    raise
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), NO_ENGINE_RECHECK_S)
                except TimeoutError:
                    pass

    async def generate(self, state, input_ids: list[int], sampling_params: dict, rid: str, extra: dict | None = None) -> GenerateResult:
        """Route one generate call (``state.engine_id`` is the affinity, updated here)."""
        handle = await self._pick_waiting(getattr(state, "engine_id", None))
        route, extra = self._with_adapter(self._with_mask(handle, sampling_params, extra))
        handle.rids.add(rid)
        handle.routed += 1
        asked_at = time.monotonic()
        try:
            res = await self._unless_lost(handle, rid, handle.client.generate(input_ids, sampling_params, rid=rid, extra=extra,
                                                                              timeout_s=self.call_timeout(sampling_params)))
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
        handle.observe_version(res.weight_version, asked_at)
        if state is not None:
            state.engine_id = handle.id
        return res if route is None else res.labelled(route[1])

    @staticmethod
    def _with_mask(handle: EngineHandle, sampling_params: dict, extra: dict | None) -> dict | None:
        """``extra`` asking for sampling masks where :func:`asks_sampling_mask` says so (the
        result's ``sampling_logprobs`` then hold the behaviour log-probs)."""
        if not asks_sampling_mask(sampling_params, handle.release):
            return extra
        return {**(extra or {}), "return_sampling_mask": True}

    def _with_adapter(self, extra: dict | None) -> tuple[tuple[str, int] | None, dict | None]:
        """The adapter route at the time of the call, and ``extra`` asking for it."""
        route = self.serving.adapter_route
        return route, extra if route is None else {**(extra or {}), "lora_path": route[0]}

    async def generate_stream(self, state, input_ids: list[int], sampling_params: dict, rid: str, extra: dict | None = None):
        """Streaming variant of :meth:`generate`: yields cumulative results."""
        handle = await self._pick_waiting(getattr(state, "engine_id", None))
        route, extra = self._with_adapter(self._with_mask(handle, sampling_params, extra))
        handle.rids.add(rid)
        handle.routed += 1
        asked_at = time.monotonic()
        last = None
        stream = handle.client.generate_stream(input_ids, sampling_params, rid=rid, extra=extra,
                                               timeout_s=self.call_timeout(sampling_params))
        try:
            while True:
                try:
                    res = await self._unless_lost(handle, rid, anext(stream))
                except StopAsyncIteration:
                    break
                last = res
                yield res if route is None else res.labelled(route[1])
        except EngineUnavailable:
            self._note_failure(handle, "connection failed")
            raise
        finally:
            handle.rids.discard(rid)
            await stream.aclose()
        handle.consecutive_failures = 0
        handle.served += 1
        if last is not None:
            handle.tokens_decoded += last.completion_tokens
            handle.observe_version(last.weight_version, asked_at)
        if state is not None:
            state.engine_id = handle.id

    def call_timeout(self, sampling_params: dict) -> float:
        """Seconds one generate call may take: ``request_timeout_s`` when set, else the floor
        plus ``max_new_tokens`` at ``min_decode_tokens_per_s`` (one token when not given)."""
        if self.request_timeout_s is not None:
            return self.request_timeout_s
        max_new = int(sampling_params.get("max_new_tokens") or 1)
        return self.request_timeout_floor_s + max_new / self.min_decode_tokens_per_s

    async def _unless_lost(self, handle: EngineHandle, rid: str, call):
        """Await ``call`` unless ``handle`` leaves rotation first: then cancel it, abort ``rid``
        there in the background (a stuck engine may recover and should not go on with it) and
        raise :class:`EngineLost`, which the turn loop retries on another engine."""
        if handle.lost.is_set():
            call.close()
            raise EngineLost(f"engine {handle.id} is {handle.state}: {handle.reason}")
        task = asyncio.ensure_future(call)
        lost = asyncio.ensure_future(handle.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # our caller is cancelled (a client gone mid-stream): the call unwinds
            lost.cancel()  # before anything closes the stream it reads (issue 67 L3: "aclose(): asynchronous
            task.cancel()  # generator is already running", logged as an unhandled error per disconnect)
            await asyncio.gather(task, return_exceptions=True)
            raise
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
        if task.cancelled() or not task.done():
            await asyncio.gather(task, return_exceptions=True)  # let the cancelled call unwind (a stream closes after it)
            handle.evicted += 1
            self._background.add(abort := asyncio.create_task(self._abort_quietly(handle, rid)))
            abort.add_done_callback(self._background.discard)
            log.warning("engine %s went %s (%s) with %s in flight: taken back", handle.id, handle.state, handle.reason, rid)
            raise EngineLost(f"engine {handle.id} went {handle.state} ({handle.reason}) during the call")
        return task.result()

    async def _abort_quietly(self, handle: EngineHandle, rid: str) -> None:
        try:
            await handle.client.abort(rid=rid, timeout_s=HEALTH_TIMEOUT_S)
        except EngineError as exc:
            log.debug("abort of %s on the lost engine %s: %s", rid, handle.id, exc)

    def _note_failure(self, handle: EngineHandle, why: str) -> None:
        handle.consecutive_failures += 1
        if handle.state == "healthy" and handle.consecutive_failures >= UNHEALTHY_AFTER:
            handle.set_state("unhealthy", why)
            log.warning("engine %s (%s) marked unhealthy: %s", handle.id, handle.url, why)

    async def abort_inflight(self, prefix: str = "", everything: bool = False) -> None:
        """Abort this service's in-flight requests whose rid starts with ``prefix``, on every
        engine, each by its exact rid (module docstring). ``everything``: on each engine that
        still has such a request, abort *all* its requests instead (``abort_all``): SGLang
        0.5.20+ passes only the first exact-rid abort of a request to its scheduler, so one that
        arrived before the request was scheduled is used up and its repeats are dropped.
        Calls still waiting for a routable engine look again at once (a pause sends them back
        to the gate: ``PausedWhileRouting``) instead of at their next 1 s wake-up."""
        self._changed.set()
        await asyncio.gather(*(self._abort_on(h, prefix, everything) for h in list(self.engines.values())))

    async def abort_rids(self, rids: set[str]) -> None:
        """Abort these requests of this service, each by its exact rid on the engine holding it;
        never everything on an engine (a per-request pause keeps the other calls there)."""
        await asyncio.gather(*(self._abort_on(h, "", only=rids) for h in list(self.engines.values())))

    async def _abort_on(self, handle: EngineHandle, prefix: str, everything: bool = False,
                        only: set[str] | None = None) -> None:
        # An abort answers at once from a live engine. One that does not answer within the
        # liveness timeout is hung: its calls are taken back by the health check (``lost``)
        # within HEALTH_INTERVAL_S + HEALTH_TIMEOUT_S, so a pause never waits the control
        # timeout on it (issue 33).
        limit = min(self.control_timeout_s, HEALTH_TIMEOUT_S)
        rids = [r for r in handle.rids if r.startswith(prefix) and (only is None or r in only)]
        if everything and rids:
            try:
                await handle.client.abort(abort_all=True, timeout_s=limit)
            except EngineError as exc:
                log.warning("abort of everything on engine %s failed: %s", handle.id, exc)
            return

        async def one(rid: str) -> None:
            try:
                await handle.client.abort(rid=rid, timeout_s=limit)
            except EngineError as exc:
                log.warning("abort of %s on engine %s failed: %s", rid, handle.id, exc)

        await asyncio.gather(*(one(r) for r in rids))

    # -- health (rollout_service/engines/health.py) ---------------------------------------
    async def check_once(self) -> None:
        await self.health.check_once()

    async def refresh_versions(self, engine_ids: list[str] | None = None) -> None:
        await self.health.refresh_versions(engine_ids)

    async def serves(self, version: int) -> tuple[bool | None, list[int | None]]:
        return await self.health.serves(version)

    def refresh_versions_soon(self, engine_ids: list[str] | None = None) -> None:
        """:meth:`refresh_versions` in the background (the caller's answer does not wait for it)."""
        task = asyncio.create_task(self.refresh_versions(engine_ids))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def health_loop(self, stop: asyncio.Event) -> None:
        await self.health.loop(stop)

    def snapshot(self) -> list[dict[str, Any]]:
        return [h.snapshot() for h in self.engines.values()]
