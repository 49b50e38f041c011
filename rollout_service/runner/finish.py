"""Turning a finished agent into a wire Trajectory, and scoring it.

The reward sees only what the model wrote: the texts of its assistant turns (with tool-call
tags), never tool results or environment text (a tool printing ``\\boxed{42}`` must not
score).
"""

from __future__ import annotations

import math
import time
from typing import Any

from asyncrl.chat import ChatTokenizer
from asyncrl.wire import REWARD_BOUND, Trajectory
from rollout_service.agent.routes import trajectory_routes
from rollout_service.agent.state import AgentState

REWARD_DETAIL_KEYS_LIMIT = 32


def model_text(state: AgentState, chat: ChatTokenizer) -> str:
    """Concatenated text of the model's own tokens (loss mask 1), turn by turn."""
    pieces: list[list[int]] = []
    current: list[int] = []
    for tok, mask in zip(state.token_ids[state.prompt_length:], state.loss_mask):
        if mask:
            current.append(tok)
        elif current:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    return "\n".join(chat.decode_turn(p) for p in pieces)


def to_trajectory(state: AgentState, run_version: int) -> Trajectory:
    """The wire form of a DONE agent. A reward that is not finite or beyond
    ``asyncrl.wire.REWARD_BOUND`` (a reward function's fault, never the model's) is published
    as 0 with ``failure = "reward_error"``: the trainer excludes it and counts it."""
    start = state.version_start if state.version_start is not None else run_version
    end = state.version_end if state.version_end is not None else start
    details: dict[str, Any] = dict(list(state.reward_details.items())[:REWARD_DETAIL_KEYS_LIMIT])
    reward, failure = float(state.reward), state.failure or ""
    if not (math.isfinite(reward) and abs(reward) <= REWARD_BOUND):  # never trained: a reward function's fault
        details["reward_error"] = f"reward {reward!r} is not finite or beyond ±{REWARD_BOUND:g}"
        reward, failure = 0.0, failure or "reward_error"
    return Trajectory(
        id=state.id, run_id=state.run_id, group_id=state.group_id, group_size=state.group_size,
        group_index=state.group_index, prompt_id=state.prompt_id, data_source=state.data_source,
        token_ids=state.token_ids, prompt_length=max(1, state.prompt_length), loss_mask=state.loss_mask,
        rollout_logprobs=state.logprobs, weight_versions=state.versions, reward=reward,
        reward_details=details, finish_reason=state.finish_reason or "error",  # type: ignore[arg-type]
        num_turns=state.assistant_turns, num_tool_calls=state.num_tool_calls, version_start=start,
        version_end=max(start, end), timings=dict(state.timings),
        temperature=state.sampling[0].logprob_temperature if state.sampling else state.temperature,
        sampling=list(state.sampling), failure=failure,  # type: ignore[arg-type]
        behaviour_logprobs=[state.behaviour_logprobs.get(i, lp) for i, lp in enumerate(state.logprobs)]
        if state.behaviour_logprobs else [],
        created_at=time.time(), attempt=state.attempt, messages=state.messages,
        metadata={"decoded_tokens": state.decoded_tokens, "resumed_after_abort": state.resumed_after_abort,
                  "invalid_tool_calls": state.invalid_tool_calls, "user_turns": state.user_turns},
        routed_experts=trajectory_routes(state),
    )
