"""The engines as the sync agent sees them (issue 50 item 5: the fleet view, out of the
coordinator): a client per engine, who answers, and a typed
:class:`~asyncrl.wire.sync.EngineView` of each.

- :meth:`Fleet.client` is the one place an engine client is made, and it refuses an engine
  the config does not allow (``engines.urls``' hosts or ``engines.allowed_hosts``): the keys,
  pauses and weights never go anywhere else (issue 48).
- :meth:`Fleet.views` lists the rollout service's engines (those not allowed are left out,
  logged once each), asks each ``/model_info`` through :class:`~sync_agent.liveness.EngineLiveness`
  (an engine that missed a probe is not waited for) and keeps the last answer
  (:attr:`last_views`, for ``/metrics``).
- :func:`held_because` says why a quarantined engine is still out and what brings it back.

The coordinator owns the state the views are judged against (the version, the engines that
need a reload, the reload source) and passes it in; the fleet keeps none of it.
"""

from __future__ import annotations

import asyncio
import logging

from asyncrl.config import secret
from asyncrl.engine_client import EngineClient
from asyncrl.engine_urls import engine_url_refusal
from asyncrl.wire.rollout_admin import EngineState, RolloutStatus
from asyncrl.wire.sync import EngineView, weight_version_number
from sync_agent.liveness import EngineLiveness
from sync_agent.rollout_admin import RolloutAdmin

log = logging.getLogger(__name__)

AGENT_REASON = "sync-agent:"  # prefix of quarantine reasons set by the agent (only those are released by it)


class Fleet:
    """See the module docstring. ``engines``: the config's ``engines`` section."""

    def __init__(self, engines, engine_timeout_s: float, rollout: RolloutAdmin) -> None:
        self.engines, self.engine_timeout_s, self.rollout = engines, engine_timeout_s, rollout
        self.clients: dict[str, EngineClient] = {}
        self.liveness = EngineLiveness(engine_timeout_s)
        """Who answers /model_info; engines that missed a probe are not waited for (:mod:`.liveness`)."""
        self.last_views: list[EngineView] = []
        self.last_rollout: RolloutStatus | None = None
        """The rollout service's status as :meth:`views` last read it."""
        self._refused_urls: set[str] = set()  # engine URLs the rollout lists that the config does not allow (logged once)

    def client(self, engine_id: str, url: str) -> EngineClient:
        """The engine's client (made once per id and URL); ValueError for an engine not allowed."""
        e = self.engines
        refusal = engine_url_refusal(url, e.urls, e.allowed_hosts)
        if refusal:
            raise ValueError(refusal)
        c = self.clients.get(engine_id)
        if c is None or c.base_url != url.rstrip("/"):
            c = self.clients[engine_id] = EngineClient(url, api_key=secret(e.api_key), admin_api_key=secret(e.admin_api_key),
                                                       control_timeout_s=self.engine_timeout_s)
        return c

    def _allowed(self, listed: list[EngineState]) -> list[EngineState]:
        out = []
        for e in listed:
            refusal = engine_url_refusal(e.url, self.engines.urls, self.engines.allowed_hosts)
            if refusal:  # never send the engine keys, pauses or weights there (issue 48)
                if e.url not in self._refused_urls:
                    log.error("ignoring the rollout's engine %s: %s", e.id, refusal)
                    self._refused_urls.add(e.url)
                continue
            out.append(e)
        return out

    async def views(self, needs_reload: set[str]) -> list[EngineView]:
        """Every allowed engine of the rollout service, with its liveness and version (not yet
        ``held_because``: the caller judges that)."""

        async def view(e: EngineState) -> EngineView:
            out = EngineView(id=e.id, url=e.url, rollout_state=e.state, reason=e.reason, needs_reload=e.id in needs_reload)
            info = await self.liveness.model_info(e.id, self.client(e.id, e.url))
            if info is not None:
                out.alive, out.version = True, weight_version_number(info.get("weight_version"))
            return out

        status = await self.rollout.status()
        self.last_rollout = status
        return list(await asyncio.gather(*(view(e) for e in self._allowed(status.engines))))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)


def held_because(v: EngineView, *, version: int, needs_reload: set[str], reload_source: tuple[str, int] | None) -> str | None:
    """Why a quarantined engine is still out, and what brings it back (None when routable)."""
    if v.rollout_state != "quarantined":
        return None
    if not (v.reason or "").startswith(AGENT_REASON):
        return f"quarantined by someone else ({v.reason}): only they release it"
    if not v.alive:
        return "not answering; repaired once it answers"
    if v.id in needs_reload:
        if reload_source is None:
            return "may hold mixed weights; waits for the trainer's next full push (no reload source)"
        return f"may hold mixed weights; reload from {reload_source[0]} (version {reload_source[1]}) pending"
    if v.version != version:
        return f"serves version {v.version}, current is {version}; the next sync brings it"
    return "whole at the current version; released at the next reconcile round"
