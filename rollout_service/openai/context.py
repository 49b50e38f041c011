"""What the OpenAI-compatible routes and their handlers may use of the rollout service
(issue 34: routes on narrow protocols). :meth:`rollout_service.service.RolloutService.openai_context`
builds it; nothing in :mod:`rollout_service.openai` reaches the service object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rollout_service.agent.deps import AgentDeps
    from rollout_service.agent.external_tools import ExternalBroker
    from rollout_service.api.limits import InflightLimit
    from rollout_service.openai.chat_cache import ChatCache
    from rollout_service.openai.sessions import SessionManager


class SessionRunner(Protocol):
    """The runner as sessions and completions use it: the agents' dependencies (engines, gate,
    sampling), admission of an external group, and the outbox."""

    deps: AgentDeps

    @property
    def version(self) -> int: ...

    def admit_external(self, group_id: str, group_size: int, recorded_members: int = 0) -> tuple[int, str] | None: ...

    async def drop_member(self, group_id: str) -> None: ...

    async def enqueue(self, traj: Any) -> None: ...


@dataclass(frozen=True)
class OpenAIContext:
    api: Any
    """The ``api`` section (limits, model aliases, session TTL, public URL)."""
    max_model_len: int
    model_path: str
    """``model.path``: a client may name the model by it (never shown)."""
    run_id: str
    model_name: str
    """The served model id (:func:`rollout_service.openai.handlers.served_model_name`)."""
    started_at: float
    api_token: str | None
    """The data plane's bearer token (None: open, loopback only)."""
    environment_tokens: dict[str, str | None]
    """Per environment: the token its tool-call long-poll needs instead of the data plane's."""
    chats: ChatCache
    sessions: SessionManager
    runner: SessionRunner
    stateless: InflightLimit
    long_polls: InflightLimit
    broker: ExternalBroker
