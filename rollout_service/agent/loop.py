"""Running one agent: the multi-turn tool loop over an engine, by token ids.

``run_agent(state, deps)`` advances an :class:`AgentState` until it is DONE (or the task is
cancelled — the state keeps what was already checkpointed). Contract:

- generation is by token ids with logprobs; every model token is appended with mask 1, its
  engine logprob and the integer weight version that produced it (from the engine's
  ``meta_info``, per-token spans when weights changed mid-request);
- tool results are rendered by the chat template into an environment segment appended with
  mask 0, logprob 0.0, version -1;
- an aborted generation (a pause for a weight sync, or any engine-side abort) keeps its
  partial tokens; the agent waits for the pause gate to open and asks the engine to continue
  from the full sequence with the rest of the turn's token budget — no decoded token is lost;
- limits: ``max_assistant_turns``, ``max_user_turns``, ``rollout.response_length`` across
  turns (model + tool tokens), ``max_new_tokens`` per turn, ``model.max_model_len``,
  ``max_parallel_calls``, per-tool ``tool_timeout_s``; a tool error becomes an error message
  to the model, never a crash;
- the agent checkpoints (``deps.checkpoint``) when it starts, after each turn, after tool
  results and when it parks at a pause.

Engine failures (connection lost, 5xx) are retried on another engine with backoff up to
``ENGINE_RETRIES`` times, then the trajectory finishes with ``finish_reason="error"``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.config.sections_core import MultiTurnConfig, SamplingConfig
from asyncrl.engine_client.errors import EngineError
from asyncrl.engine_client.types import GenerateResult
from rollout_service.agent.chat import ChatTokenizer
from rollout_service.agent.state import AgentState, PendingCall, Phase
from rollout_service.agent.tool_parser import ParsedTurn

log = logging.getLogger(__name__)

ENGINE_RETRIES = 5  # engine errors tolerated per trajectory before it ends with "error"
ENGINE_RETRY_BACKOFF_S = 0.5


class Generator(Protocol):
    async def generate(self, state: AgentState, input_ids: list[int], sampling_params: dict, rid: str,
                       extra: dict | None = None) -> GenerateResult: ...


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
    version_of: Callable[[str | None], int]
    multi_turn: MultiTurnConfig
    sampling: SamplingConfig
    response_length: int
    max_model_len: int
    rid_prefix: str
    on_tokens: Callable[[int, int], None] = lambda decoded, kept: None
    """Called with (tokens the engine decoded, tokens kept) after every generate call."""
    extra_sampling: dict = field(default_factory=dict)
    """Extra sampling params (OpenAI requests: ``stop``, ``sampling_seed``...)."""
    external: Any = None
    """The :class:`ExternalBroker` for tools answered by outside environments (None: none)."""


async def run_agent(state: AgentState, deps: AgentDeps) -> AgentState:
    """Advance ``state`` to DONE (see the module docstring)."""
    t0 = time.monotonic()
    try:
        if state.phase == Phase.PENDING:
            _start(state, deps)
            await deps.checkpoint(state)
        while state.phase != Phase.DONE:
            if state.phase == Phase.GENERATING:
                await _generate_turn(state, deps)
                if state.phase == Phase.TOOLS:
                    await deps.checkpoint(state)
            elif state.phase in (Phase.TOOLS, Phase.AWAITING_ENV):
                await _run_tools(state, deps)
            else:
                raise RuntimeError(f"agent {state.id}: phase {state.phase} cannot run here")
        if state.finish_reason != "error":
            state.reward, state.reward_details = await deps.reward(state)
        return state
    finally:
        state.add_timing("active", time.monotonic() - t0)


def _start(state: AgentState, deps: AgentDeps) -> None:
    prompt = deps.chat.prompt_ids(state.messages)
    state.token_ids = list(prompt)
    state.prompt_length = len(prompt)
    state.turn_start = len(prompt)
    state.temperature = deps.sampling.temperature if deps.sampling.temperature > 0 else 1.0
    state.created_at = state.created_at or time.time()
    state.phase = Phase.GENERATING
    if state.prompt_length >= deps.max_model_len:
        _finish(state, "length")


def _finish(state: AgentState, reason: str) -> None:
    state.phase = Phase.DONE
    state.finish_reason = reason
    state.pending_calls = []


def turn_budget(state: AgentState, deps: AgentDeps) -> int:
    used_in_turn = len(state.token_ids) - state.turn_start
    return min(
        deps.sampling.max_new_tokens - used_in_turn,
        deps.response_length - state.response_length,
        deps.max_model_len - len(state.token_ids),
    )


def sampling_params(deps: AgentDeps, max_new: int) -> dict:
    s = deps.sampling
    params = {"max_new_tokens": max_new, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
              "stop_token_ids": [deps.chat.eos_token_id], "skip_special_tokens": False, "no_stop_trim": True}
    return {**params, **deps.extra_sampling}


async def generate_turn_tokens(state: AgentState, deps: AgentDeps, extra: dict | None = None) -> tuple[bool | None, GenerateResult | None]:
    """Generate one assistant turn onto ``state`` (abort → wait for the gate → continue, as
    described in the module docstring). Returns (ended, last engine result): ended is True
    when the turn ended with the end-of-turn token, False when it hit a token budget, None
    when the engines kept failing (the state is then DONE with ``finish_reason="error"``).
    ``extra`` goes into the /generate body."""
    last: GenerateResult | None = None
    failures = 0
    while True:
        await deps.gate.wait_open()
        max_new = turn_budget(state, deps)
        if max_new <= 0:
            return False, last
        rid = f"{deps.rid_prefix}{state.id}.t{state.assistant_turns}.s{state.segment}"
        t0 = time.monotonic()
        try:
            res = await deps.generator.generate(state, state.token_ids, sampling_params(deps, max_new), rid, **({"extra": extra} if extra else {}))
        except EngineError as exc:
            failures += 1
            log.warning("agent %s: engine error %d/%d: %s", state.id, failures, ENGINE_RETRIES, exc)
            if failures >= ENGINE_RETRIES:
                _finish(state, "error")
                state.reward_details["error"] = f"engine: {exc}"
                return None, last
            state.engine_id = None  # let the router pick another engine
            await asyncio.sleep(ENGINE_RETRY_BACKOFF_S * failures)
            continue
        finally:
            state.add_timing("generate", time.monotonic() - t0)
        append_model_tokens(state, res, deps)
        last = res
        if res.aborted:
            state.segment += 1
            state.resumed_after_abort += 1
            if deps.gate.paused:
                await deps.checkpoint(state)  # parked mid-turn; continues after resume
            continue
        ended = res.finish_reason.type == "stop" and bool(res.output_ids) and res.output_ids[-1] == deps.chat.eos_token_id
        return ended, res


async def _generate_turn(state: AgentState, deps: AgentDeps) -> None:
    ended_by_eos, _ = await generate_turn_tokens(state, deps)
    if ended_by_eos is None:
        return
    _after_turn(state, deps, ended_by_eos)


def append_model_tokens(state: AgentState, res: GenerateResult, deps: AgentDeps) -> None:
    logprobs = res.logprobs if res.logprobs is not None or res.output_ids else []  # aborted while queued: no tokens
    if logprobs is None or len(logprobs) != len(res.output_ids):
        raise EngineError(f"engine returned {len(res.output_ids)} tokens without matching logprobs (rid {res.rid})")
    versions = [deps.version_of(v) for v in res.token_versions()]
    state.token_ids.extend(res.output_ids)
    state.loss_mask.extend([1] * len(res.output_ids))
    state.logprobs.extend(logprobs)
    state.versions.extend(versions)
    state.decoded_tokens += res.completion_tokens
    if versions:
        if state.version_start is None:
            state.version_start = versions[0]
        state.version_end = versions[-1]
    deps.on_tokens(res.completion_tokens, len(res.output_ids))


def _after_turn(state: AgentState, deps: AgentDeps, ended_by_eos: bool) -> None:
    turn_ids = state.token_ids[state.turn_start:]
    state.assistant_turns += 1
    text = deps.chat.decode_turn(turn_ids)
    if not ended_by_eos:
        state.messages.append({"role": "assistant", "content": text})
        return _finish(state, "length")
    parsed = deps.parse(text, state.assistant_turns - 1)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [c.as_openai() for c in parsed.calls]
    state.messages.append(message)
    if not parsed.calls:
        return _finish(state, "stop")
    if state.assistant_turns >= deps.multi_turn.max_assistant_turns or state.user_turns >= deps.multi_turn.max_user_turns:
        return _finish(state, "turn_limit")
    limit = deps.multi_turn.max_parallel_calls
    state.pending_calls = [
        PendingCall(id=c.id, name=c.name, arguments=c.arguments,
                    error=c.error if i < limit else f"too many tool calls in one turn (limit {limit})")
        for i, c in enumerate(parsed.calls)
    ]
    state.invalid_tool_calls += sum(1 for c in parsed.calls if c.error)
    state.phase = Phase.TOOLS


async def _run_tools(state: AgentState, deps: AgentDeps) -> None:
    t0 = time.monotonic()
    todo = [c for c in state.pending_calls if c.result is None]

    external = deps.external
    parked = [c for c in todo if c.error is None and external is not None and external.is_external(c.name)]
    if parked:
        for c in parked:
            c.external = True
            if c.deadline is None:
                c.deadline = time.time() + external.tools[c.name].deadline_s
        state.phase = Phase.AWAITING_ENV
        await deps.checkpoint(state)  # parked calls survive pauses and restarts

    async def one(call: PendingCall) -> None:
        if call.error is not None:
            call.result, call.is_error = f"Error: {call.error}", True
        elif call.external and external is not None:
            call.result, call.is_error = await external.call(state.id, call.id, call.name, call.arguments, call.deadline)
        else:
            res = await deps.tools.execute(call.name, call.arguments, timeout_s=deps.multi_turn.tool_timeout_s)
            call.result, call.is_error = res.content, res.is_error

    from rollout_service.openai.external import EpisodeExpired

    try:
        await asyncio.gather(*(one(c) for c in todo))
    except EpisodeExpired as exc:
        state.reward_details["expired"] = str(exc)
        return _finish(state, "expired")

    state.add_timing("tools", time.monotonic() - t0)
    state.num_tool_calls += len(state.pending_calls)
    limit = deps.multi_turn.max_tool_response_length
    tool_messages = [{"role": "tool", "tool_call_id": c.id, "name": c.name,
                      "content": deps.chat.truncate_text_to_tokens(c.result or "", limit)} for c in state.pending_calls]
    segment = deps.chat.environment_segment(tool_messages)
    state.pending_calls = []
    state.messages.extend(tool_messages)
    if state.response_length + len(segment) >= deps.response_length or len(state.token_ids) + len(segment) >= deps.max_model_len:
        return _finish(state, "length")
    state.token_ids.extend(segment)
    state.loss_mask.extend([0] * len(segment))
    state.logprobs.extend([0.0] * len(segment))
    state.versions.extend([-1] * len(segment))
    state.user_turns += 1
    state.turn_start = len(state.token_ids)
    state.segment = 0
    state.phase = Phase.GENERATING
    await deps.checkpoint(state)
