"""Answering one Anthropic Messages turn, on a session or stateless (issue 52): run the Chat
turn the request was lowered to (:mod:`.messages_request`) and answer with the ``message``
object (:mod:`.messages_objects`), or stream it as Anthropic's events (:mod:`.messages_stream`).

``done(outcome)`` runs when the turn is over (a session route records it). A failed turn is
never a 200 (:func:`~rollout_service.openai.handlers.raise_if_failed`; the error shape is
Anthropic's on these routes: :mod:`.messages_errors`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.chat import ChatTokenizer
from rollout_service.agent.state import AgentState
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import raise_if_failed
from rollout_service.openai.messages_objects import message_object, message_skeleton, new_message_id
from rollout_service.openai.messages_request import MessagesRequest
from rollout_service.openai.messages_stream import messages_events
from rollout_service.openai.streaming import stream_turn
from rollout_service.openai.turns import TurnOutcome, TurnSpec, run_turn


async def answer_message(ctx: OpenAIContext, state: AgentState, chat: ChatTokenizer, req: MessagesRequest, spec: TurnSpec,
                         done: Callable[[TurnOutcome], Awaitable[None]], extra: dict[str, Any] | None = None,
                         fresh_ids: bool = False):
    """The module docstring's answer: a JSONResponse, or a StreamingResponse when ``req.stream``;
    ``fresh_ids``: new ``tool_use`` ids (the stateless route: :func:`.messages_objects.content_blocks`)."""
    deps, model, message_id = ctx.runner.deps, ctx.model_name, new_message_id()
    if req.stream:
        outcome: list[TurnOutcome] = []

        async def kept(out: TurnOutcome) -> None:
            outcome.append(out)
            await done(out)

        def final() -> dict[str, Any] | None:
            return message_object(message_id, model, outcome[0], extra, fresh_ids) if outcome else None

        events = stream_turn(state, deps, chat, spec, ctx.max_model_len, model=model, want_logprobs=False,
                             include_usage=False, on_done=kept)
        skeleton = message_skeleton(message_id, model, len(state.token_ids))
        return StreamingResponse(messages_events(events, skeleton, final), media_type="text/event-stream")
    out = await run_turn(state, deps, chat, spec, ctx.max_model_len)
    await done(out)
    raise_if_failed(out)
    return JSONResponse(message_object(message_id, model, out, extra, fresh_ids))
