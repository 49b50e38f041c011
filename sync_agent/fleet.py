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
- :meth:`Fleet.problems_at_start` judges the configured engines when the agent starts.

The coordinator owns the state the views are judged against (the version, the engines that
need a reload, the reload source) and passes it in; the fleet keeps none of it.
"""

from __future__ import annotations

import asyncio
import logging

from asyncrl.config import secret
from asyncrl.config.sections_infra import ActorConfig
from asyncrl.engine_client import EngineClient
from asyncrl.engine_client.errors import EngineError
from asyncrl.engine_urls import engine_url_refusal
from asyncrl.sync_control.adapter_load import adapter_problems
from asyncrl.sync_control.engine_update import LIVENESS_TIMEOUT_S, EngineUpdate, Member
from asyncrl.sync_control.layout import LayoutError
from asyncrl.sync_control.pause_policy import PausePlan, policy_problems
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

    async def problems_at_start(self, plan: PausePlan, adapters_of: ActorConfig | None) -> list[str]:
        """Why the run cannot sync on the configured engines (``engines.urls``), read from their
        ``/server_info`` when the agent starts: a ``retract``/``in_place`` plan on engines
        without ``weight_versions`` spans or the in-place flags (issues 35, 66), and with adapter
        syncs (``adapters_of``: the actor section) an engine that cannot load the run's adapter
        (LoRA off, ``--max-lora-rank`` under ``actor.lora_rank``, ``--lora-target-modules`` not
        covering ``actor.target_modules``, ``--max-loaded-loras`` under 2: issue 36), so the run
        stops before its first sync, not at it. Engines that do not answer within the liveness
        bound are not judged here; every sync judges its members again."""
        urls = list(self.engines.urls or [])
        spans = plan.engine_mode in ("retract", "in_place")
        if not (spans or adapters_of is not None) or not urls:
            return []
        limit = min(self.engine_timeout_s, LIVENESS_TIMEOUT_S)

        async def one(url: str) -> list[str]:
            update = EngineUpdate([Member(url, self.client(url, url))], control_timeout_s=limit)
            found = []
            if spans:
                try:
                    found += policy_problems(plan, (await update.read_layouts())[0])
                except LayoutError as exc:  # a layout no weight group can update: refused now, not at every sync
                    found.append(str(exc))
                except EngineError as exc:
                    log.info("engine %s not judged at start (%s): its first sync will be", url, exc)
                    return found
            if adapters_of is not None:  # adapters travel without a weight group: the layout is not theirs to judge
                try:
                    info = await update.members[0].client.server_info(timeout_s=limit)
                except EngineError as exc:
                    log.info("engine %s not judged at start (%s): its first sync will be", url, exc)
                    return found
                found += adapter_problems(adapters_of, info, f"engine {url}")
            return found

        return [p for found in await asyncio.gather(*(one(u) for u in urls)) for p in found]

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
