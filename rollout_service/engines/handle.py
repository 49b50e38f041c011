"""One engine as the rollout service's pool holds it: its client, routing state (``healthy``,
``unhealthy``, ``quarantined``), this service's requests in flight on it (exact rids, for
aborts), counters, and the weight version it last reported (the newest-asked answer wins:
:meth:`EngineHandle.observe_version`). The pool (:mod:`.pool`) routes over handles, the
health checker (:mod:`.health`) moves them between states."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import Any

from asyncrl.engine_client import EngineClient


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
    weight_version: int | None = None
    """The version the engine said it holds in the newest-asked of its answers (see
    :meth:`observe_version`)."""
    version_asked_at: float = float("-inf")
    last_checked: float = 0.0
    tokens_decoded: int = 0
    evicted: int = 0
    """Calls taken back from this engine because it went out of rotation while they ran."""
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the engine leaves rotation: calls in flight on it stop waiting (see the module doc)."""
    release: tuple[int, int, int] | None = None
    """The engine's SGLang release (``/server_info``'s ``version``), read at its first health
    check and again after it was unhealthy (a restart may change it); None until read."""
    unfit: str | None = None
    """Why the engine's launch flags cannot serve the run (:mod:`rollout_service.engines.fitness`),
    read with its release; None: fit, or not read yet."""
    quarantined_current_s: float = 0.0
    """Seconds spent quarantined while holding the run's current weight version (capacity lost
    to a release that has not come yet), measured at each health check."""
    _accounted_at: float | None = None

    def account(self, now: float, current_version: int | None) -> None:
        """Add the time since the last call to :attr:`quarantined_current_s` if it was spent
        quarantined at the current version (the state seen now is taken for the whole interval)."""
        if self._accounted_at is not None and self.state == "quarantined" and current_version is not None \
                and self.weight_version == current_version:
            self.quarantined_current_s += now - self._accounted_at
        self._accounted_at = now

    def observe_version(self, version: int | None, asked_at: float) -> None:
        """Record a version the engine reported in an answer to a request sent at ``asked_at``
        (monotonic). An answer to an older request than the one recorded is stale (a generate
        call or a probe sent before a sync and answered after it) and is ignored: the shown
        version never goes back to what the engine held before a newer answer."""
        if version is not None and asked_at >= self.version_asked_at:
            self.weight_version, self.version_asked_at = version, asked_at

    @property
    def inflight(self) -> int:
        return len(self.rids)

    def set_state(self, state: str, reason: str | None) -> None:
        """Move to ``state``; leaving ``healthy`` releases every call waiting on the engine."""
        if state == "healthy" and self.state != "healthy":
            self.lost = asyncio.Event()
        self.state, self.reason = state, reason
        if state != "healthy":
            self.lost.set()

    def snapshot(self) -> dict[str, Any]:
        return {"id": self.id, "url": self.url, "state": self.state, "reason": self.reason, "inflight": self.inflight,
                "routed": self.routed, "served": self.served, "weight_version": self.weight_version, "tokens_decoded": self.tokens_decoded,
                "evicted": self.evicted, "quarantined_current_s": round(self.quarantined_current_s, 3)}


def engine_id_for(url: str) -> str:
    """A short stable id for an engine URL."""
    return "e-" + hashlib.sha1(url.encode()).hexdigest()[:8]
