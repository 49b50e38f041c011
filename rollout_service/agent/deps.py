"""What an agent needs from the service: the collaborators of :mod:`.turn` and :mod:`.loop`.

Each collaborator is a small protocol so that the agent code can be driven by fakes in unit
tests; the service wires the real ones (``RolloutService._deps``). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.chat import ChatTokenizer
from asyncrl.config.sections_core import MultiTurnConfig, SamplingConfig
from asyncrl.engine_client.types import GenerateResult
from rollout_service.agent.state import AgentState
from rollout_service.agent.tool_parser import ParsedTurn


class Generator(Protocol):
    """Routes generate calls to an engine (``state.engine_id`` is the affinity).

    Both calls raise :class:`~asyncrl.engine_client.errors.EngineError` on engine failures.
    ``generate_stream`` yields SGLang's cumulative results (the last carries the finish
    reason); closing it early closes the engine request.
    """

    async def generate(self, state: AgentState, input_ids: list[int], sampling_params: dict, rid: str,
                       extra: dict | None = None) -> GenerateResult: ...

    def generate_stream(self, state: AgentState, input_ids: list[int], sampling_params: dict, rid: str,
                        extra: dict | None = None) -> AsyncIterator[GenerateResult]: ...


class ToolExecutor(Protocol):
    async def execute(self, name: str, arguments: Any, timeout_s: float) -> Any: ...


class PauseGate(Protocol):
    @property
    def paused(self) -> bool: ...

    async def wait_open(self) -> None: ...


@dataclass
class AgentDeps:
    chat: ChatTokenizer
    generator: Generator
    tools: ToolExecutor
    gate: PauseGate
    parse: Callable[[str, int], ParsedTurn]
    checkpoint: Callable[[AgentState], Awaitable[None]]
    reward: Callable[[AgentState], Awaitable[tuple[float, dict[str, Any]]]]
    multi_turn: MultiTurnConfig
    sampling: SamplingConfig
    response_length: int
    max_model_len: int
    rid_prefix: str
    on_tokens: Callable[[int, int], None] = lambda decoded, kept: None
    """Called with (tokens the engine decoded, tokens kept) after every generate call."""
    extra_sampling: dict = field(default_factory=dict)
    """Extra sampling params (OpenAI requests: ``stop``, ``sampling_seed``...)."""
    stale_check: Callable[[AgentState, int], str] = lambda state, budget: ""
    """Why the agent must be cancelled before its next generate call (of ``budget`` tokens), its
    trajectory expected to be dropped for staleness ("" to go on:
    ``rollout_service.runner.per_request.between_syncs_check``)."""
    external: Any = None
    """The :class:`~rollout_service.agent.external_tools.ExternalBroker` for tools answered by
    outside environments (None: none)."""
    routes: Any = None
    """The policy's :class:`~rollout_service.agent.routes.RouteShape` when every call asks for
    routed experts (``actor.router_replay.mode = "R3"``); None: no routes."""
