"""What a run needs of each engine's launch flags, judged from its ``/server_info``.

An engine whose flags cannot serve the run is *unfit*: its health check fails with the reason
(so no call is routed to it and ``/status`` shows why), re-judged at each check while it is
out, so an engine restarted with the right flags serves again. Judged (issue 66):

- routing replay (``actor.router_replay.mode = "R3"``): every call asks for the routed
  experts, which SGLang answers only with ``--enable-return-routed-experts`` (without it, the
  answer carries no routes and every call would be an engine error: N3); and SGLang's
  hierarchical cache (``--enable-hierarchical-cache``) reloads a prefix's KV from host memory
  into new device slots without the routes captured for those slots, so a cached prefix's
  routes would be stale (N4): refused.

A key the engine does not report is not judged (an engine that is not SGLang-shaped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def routes_problem(info: dict[str, Any]) -> str | None:
    """Why an engine cannot serve routing replay, or None."""
    if info.get("enable_return_routed_experts") is False:
        return ("started without --enable-return-routed-experts: routing replay (actor.router_replay.mode=R3) needs "
                "each token's routed experts, which the engine then answers without")
    if info.get("enable_hierarchical_cache") is True:
        return ("started with --enable-hierarchical-cache: a prefix reloaded from its host cache gets new KV slots "
                "without the routes captured for them, so routing replay (R3) would train on stale routes; "
                "start it without that flag")
    return None


@dataclass(frozen=True)
class EngineRequirements:
    """What the run needs of an engine's flags (module docstring)."""

    routes: bool = False
    """Routing replay: the engine must return routed experts, without a hierarchical cache."""

    @classmethod
    def of(cls, actor) -> EngineRequirements:
        """The run's requirements, from its ``actor`` section."""
        return cls(routes=actor.router_replay.mode == "R3")

    def problem(self, info: dict[str, Any]) -> str | None:
        """Why an engine with this ``/server_info`` cannot serve the run (None: fit)."""
        return routes_problem(info) if self.routes else None
