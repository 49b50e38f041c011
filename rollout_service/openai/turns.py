"""One assistant turn for an OpenAI-API request, on an :class:`AgentState`.

Both the stateless routes and sessions use it, streamed or not: :func:`run_turn` runs the
agents' one turn loop (:func:`rollout_service.agent.turn.generate_turn_tokens`), so pauses
for weight syncs and engine failures behave as for internal agents — an aborted generation
keeps its tokens and continues after resume, a failed one is retried on another engine up
to ``ENGINE_RETRIES`` times. The request's sampling overrides the service's;
``tool_choice="required"`` (or a named function) is implemented by appending the opening of
a tool call (``<tool_call>\\n{"name": "``, plus the name when one is forced) as tokens with
loss mask 0 — the model did not choose them, so they are never trained on — and letting the
model continue, unconstrained (no grammar, unlike SGLang's OpenAI server). OpenAI promises a
call then: a turn that produced no parsable one fails explicitly (``TurnOutcome.error``: 422
``tool_choice_not_satisfied``, the text it produced in the message), never a silent answer
without calls (docs/openai_api.md).

A turn never checkpoints into the agents bucket: its state is not an internal agent (a
restart would run it as one). Sessions persist their state after each turn themselves
(``SessionManager.save``); a turn cut by a restart is lost and the client asks again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from asyncrl.chat import ChatTokenizer
from asyncrl.config.sections_core import SamplingConfig
from asyncrl.engine_client.types import GenerateResult
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.state import AgentState
from rollout_service.agent.tool_parser import ParsedTurn, parse_hermes
from rollout_service.agent.turn import ChunkHook, generate_turn_tokens


@dataclass
class TurnSpec:
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    tool_choice: str | dict | None = "auto"
    parallel_tool_calls: bool = True

    def forced_prefix(self) -> str:
        if isinstance(self.tool_choice, dict):
            return '<tool_call>\n{"name": "' + self.tool_choice["function"]["name"] + '", "arguments": '
        if self.tool_choice == "required":
            return '<tool_call>\n{"name": "'
        return ""


@dataclass(frozen=True)
class TurnError:
    """Why a turn failed: ``status`` None = the engines kept failing (503, or 502 in a stream),
    else the HTTP status to answer; ``code`` the error envelope's code when not the status."""

    status: int | None
    message: str
    code: str | None = None
    param: str | None = None


@dataclass
class TurnOutcome:
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    model_ids: list[int]
    model_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    weight_version: int | None
    ended_by_eos: bool
    prompt_tokens: int
    completion_tokens: int
    error: TurnError | None = None
    """Set exactly when ``finish_reason`` is ``error``."""
    stop_sequence: str | None = None
    """The request's stop string the turn ended on (``finish_reason`` ``stop``), if it was one."""


async def _no_checkpoint(state: AgentState) -> None:
    return None


def turn_deps(base: AgentDeps, chat: ChatTokenizer, spec: TurnSpec, response_budget: int) -> AgentDeps:
    """The service's agent deps with the request's sampling, and no checkpointing."""
    sampling = SamplingConfig(temperature=spec.temperature, top_p=spec.top_p, max_new_tokens=spec.max_new_tokens)
    extra: dict[str, Any] = {}
    if spec.stop:
        extra["stop"] = spec.stop
    if spec.seed is not None:
        extra["sampling_seed"] = spec.seed
    return dataclasses.replace(base, chat=chat, sampling=sampling, extra_sampling=extra, response_length=response_budget,
                               checkpoint=_no_checkpoint)


def append_forced_prefix(state: AgentState, chat: ChatTokenizer, spec: TurnSpec) -> None:
    """Append the text ``tool_choice`` forces (e.g. ``<tool_call>``) as prompt-side tokens:
    loss mask 0, logprob 0, version -1 (the engine did not choose them)."""
    forced = spec.forced_prefix()
    if forced:
        ids = chat.encode_text(forced)
        state.token_ids.extend(ids)
        state.loss_mask.extend([0] * len(ids))
        state.logprobs.extend([0.0] * len(ids))
        state.versions.extend([-1] * len(ids))


async def run_turn(state: AgentState, base: AgentDeps, chat: ChatTokenizer, spec: TurnSpec, response_budget: int, *,
                   on_chunk: ChunkHook | None = None) -> TurnOutcome:
    """Generate one assistant turn onto ``state`` and describe it in OpenAI terms.
    ``on_chunk``: stream from the engine and see every cumulative result (see
    :func:`~rollout_service.agent.turn.generate_turn_tokens`)."""
    prompt_tokens = len(state.token_ids)
    append_forced_prefix(state, chat, spec)
    deps = turn_deps(base, chat, spec, response_budget)
    extra = {"top_logprobs_num": spec.top_logprobs} if spec.top_logprobs else None
    ended, kept = await generate_turn_tokens(state, deps, extra, on_chunk=on_chunk)
    return describe_turn(state, chat, spec, ended, kept, prompt_tokens)


def describe_turn(state: AgentState, chat: ChatTokenizer, spec: TurnSpec, ended: bool | None,
                  results: list[GenerateResult], prompt_tokens: int) -> TurnOutcome:
    """Close the turn on ``state`` (turn counter) and describe it in OpenAI terms."""
    last = results[-1] if results else None
    state.assistant_turns += 1
    turn_ids = state.token_ids[state.turn_start:]
    text = chat.decode_turn(turn_ids)
    model_ids = [t for t, m in zip(state.token_ids[state.turn_start:], state.loss_mask[state.turn_start - state.prompt_length:]) if m]
    model_lps = [lp for lp, m in zip(state.logprobs[state.turn_start - state.prompt_length:], state.loss_mask[state.turn_start - state.prompt_length:]) if m]
    parsed = parse_hermes(text, state.assistant_turns - 1) if spec.tool_choice != "none" else ParsedTurn(text, [])
    calls = [c for c in parsed.calls if c.error is None]
    if not spec.parallel_tool_calls:
        calls = calls[:1]
    error = None
    forced = spec.tool_choice == "required" or isinstance(spec.tool_choice, dict)
    if ended is None:
        finish = "error"
        status = state.reward_details.get("engine_status")
        error = TurnError(int(status) if status is not None else None,
                          str(state.reward_details.get("error", "the engines failed")).removeprefix("engine: "))
    elif forced and not calls:
        finish = "error"
        how = "stopped" if last is not None and last.finish_reason.type == "stop" else "hit max_tokens"
        error = TurnError(422, f"tool_choice {'required' if spec.tool_choice == 'required' else 'named'} was not satisfied: the "
                               f"model {how} after {len(turn_ids)} tokens without a parsable tool call; it wrote {text[:300]!r}",
                          code="tool_choice_not_satisfied", param="tool_choice")
    elif calls:
        finish = "tool_calls"
    elif last is not None and last.finish_reason.type == "stop":
        finish = "stop"
    else:
        finish = "length"
    tops = None
    if spec.top_logprobs:
        tops = []
        for res in results:
            for entry in (res.meta_info.get("output_top_logprobs") or [])[: len(res.output_ids)]:
                tops.append([(int(t[1]), float(t[0])) for t in (entry or [])])
    return TurnOutcome(
        text=text, content=parsed.content if (parsed.content or not calls) else None,
        tool_calls=[c.as_openai() for c in calls], finish_reason=finish, model_ids=model_ids, model_logprobs=model_lps,
        top_logprobs=tops, weight_version=last.weight_version if last else None, ended_by_eos=bool(ended),
        prompt_tokens=prompt_tokens, completion_tokens=len(turn_ids), error=error,
        stop_sequence=matched if finish == "stop" and isinstance(matched := last.finish_reason.matched, str)
        and matched in spec.stop else None,
    )
