"""What the HTTP routes may use of the rollout service: narrow protocols and the admin
router's ports (issue 34). A route depends on these, never on the service object, so what it
can reach is in its signature; :class:`rollout_service.service.RolloutService` builds them
(``admin_ports``, ``openai_context``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from asyncrl.wire.rollout_admin import RolloutStatus
from rollout_service.runner.snapshot import RunnerSnapshot


class RunnerControl(Protocol):
    """The runner as the admin routes drive it: read through its snapshot, paused and resumed."""

    def snapshot(self) -> RunnerSnapshot: ...

    async def pause(self, mode: str, timeout_s: float) -> None: ...

    async def resume(self, version: int) -> None: ...


class EngineAdmin(Protocol):
    """The engine pool as the admin routes change it (:class:`rollout_service.engines.EnginePool`)."""

    engines: Mapping[str, Any]

    def add(self, url: str, engine_id: str | None = None) -> Any: ...

    async def remove(self, engine_id: str, abort_inflight: bool = True) -> Any: ...

    async def check_once(self) -> None: ...

    def set_quarantine(self, engine_id: str, quarantined: bool, reason: str | None = None) -> Any: ...

    def refresh_versions_soon(self, engine_ids: list[str] | None = None) -> None: ...

    async def serves(self, version: int) -> tuple[bool | None, list[int | None]]: ...


@dataclass(frozen=True)
class AdminPorts:
    """Everything ``/admin/*`` uses."""

    admin_token: str | None
    runner: RunnerControl
    engines: EngineAdmin
    status: Callable[[], RolloutStatus]
    """The service's status now (every admin action answers with it)."""
    validate: Callable[[], Awaitable[dict]]
    """Run the validation set at the current version; its metrics."""
    pause_mode: str
    """The rollout's pause mode when a pause names none (``sync.pause_policy``'s plan)."""
    pause_timeout_s: float
    """``rollout.pause_timeout_s``: a pause that names no timeout waits this long."""
    engine_refusal: Callable[[str], str | None] = lambda url: None
    """Why an engine URL may not be added (``asyncrl.engine_urls``), or None."""
