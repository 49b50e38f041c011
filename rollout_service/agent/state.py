"""The persistent state of one trajectory's agent.

An agent is a state machine::

    PENDING → GENERATING ⇄ TOOLS (⇄ AWAITING_ENV for external tools) → DONE

Everything needed to continue from exactly where it stopped lives in :class:`AgentState`:
the token sequence with per-token loss mask, logprobs and weight versions, the chat
transcript, turn counters, the tool calls of the current turn with the results already
obtained, and timings. It is a msgspec Struct so it can be checkpointed (MessagePack) to
the run's JetStream KV bucket at turn boundaries and at pause, and restored after a crash
of the rollout service.

A GENERATING agent may hold a partial assistant turn (``turn_start`` marks where the
current turn's tokens begin): after an abort at a weight sync the engine is asked to
continue from ``token_ids`` with the rest of the turn's budget, and new tokens carry the new
weight version — verl's partial rollout.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from asyncrl.wire import RoutedExperts, SamplingSpan


class Phase(str, enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    TOOLS = "tools"
    AWAITING_ENV = "awaiting_env"
    DONE = "done"


class PendingCall(msgspec.Struct, kw_only=True):
    id: str
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    error: str | None = None
    result: str | None = None
    """Filled once the call has an answer (the agent resumes without re-running it)."""
    is_error: bool = False
    external: bool = False
    deadline: float | None = None


class AgentState(msgspec.Struct, kw_only=True):
    id: str
    run_id: str
    group_id: str
    group_size: int
    group_index: int
    prompt_id: str
    data_source: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = msgspec.field(default_factory=dict)
    attempt: int = 0
    phase: Phase = Phase.PENDING

    token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_length: int = 0
    loss_mask: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    versions: list[int] = msgspec.field(default_factory=list)
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)

    turn_start: int = 0
    """Index in ``token_ids`` where the current assistant turn's tokens begin."""
    segment: int = 0
    """Generate calls within the current turn (a resume after abort starts a new segment)."""
    assistant_turns: int = 0
    user_turns: int = 0
    num_tool_calls: int = 0
    invalid_tool_calls: int = 0
    pending_calls: list[PendingCall] = msgspec.field(default_factory=list)

    version_start: int | None = None
    version_end: int | None = None
    engine_id: str | None = None
    """Engine that served the last turn (kept for prefix-cache affinity)."""
    decoded_tokens: int = 0
    """Tokens the engines reported generating for this agent (kept + any thrown away)."""
    resumed_after_abort: int = 0
    finish_reason: str | None = None
    reward: float = 0.0
    reward_details: dict[str, Any] = msgspec.field(default_factory=dict)
    temperature: float = 1.0
    sampling: list[SamplingSpan] = msgspec.field(default_factory=list)
    """Sampling parameters per span of the response (``asyncrl.wire.trajectory``): a span
    starts wherever a generate call used different ones than the span before."""
    behaviour_logprobs: dict[int, float] = msgspec.field(default_factory=dict)
    """Response offset → the model token's log-prob under the truncated distribution it was
    drawn from, where the engine reported it (``Trajectory.behaviour_logprobs``)."""
    failure: str = ""
    """Infrastructure failure that spoiled the episode (``Trajectory.failure``); "" if none."""
    cancelled: str = ""
    """Why a per-request pause cancelled it for staleness (its call's next result ends it:
    ``rollout_service.runner.per_request``); "" if not."""
    created_at: float = 0.0
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    routed_experts: RoutedExperts | None = None
    """With router replay: the routes of the positions computed so far (:mod:`.routes`)."""

    @property
    def response_length(self) -> int:
        return len(self.token_ids) - self.prompt_length

    def add_timing(self, key: str, seconds: float) -> None:
        self.timings[key] = self.timings.get(key, 0.0) + seconds


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AgentState)


def encode_state(state: AgentState) -> bytes:
    return _encoder.encode(state)


def decode_state(data: bytes) -> AgentState:
    return _decoder.decode(data)
