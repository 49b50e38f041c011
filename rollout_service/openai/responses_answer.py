"""Answering one Responses API turn, on a session or stateless (issue 52): run the Chat turn
the request was lowered to (:mod:`.responses_request`) and answer with the ``response`` object,
or stream it as the Responses events (:mod:`.responses_stream`).

``done(outcome)`` runs when the turn is over (the route records it and stores the object);
``stored()`` then returns the ``response`` object to answer with (None if the turn did not
complete). A failed turn is never a 200 (:func:`~rollout_service.openai.handlers.raise_if_failed`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.chat import ChatTokenizer
from rollout_service.agent.state import AgentState
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import raise_if_failed
from rollout_service.openai.responses_objects import response_skeleton
from rollout_service.openai.responses_request import ResponsesRequest
from rollout_service.openai.responses_stream import responses_events
from rollout_service.openai.streaming import stream_turn
from rollout_service.openai.turns import TurnOutcome, TurnSpec, run_turn


async def answer_response(ctx: OpenAIContext, state: AgentState, chat: ChatTokenizer, req: ResponsesRequest, spec: TurnSpec,
                          response_id: str, done: Callable[[TurnOutcome], Awaitable[None]],
                          stored: Callable[[], dict[str, Any] | None]):
    """The module docstring's answer: a JSONResponse, or a StreamingResponse when ``req.stream``."""
    deps, model = ctx.runner.deps, ctx.model_name
    if req.stream:
        events = stream_turn(state, deps, chat, spec, ctx.max_model_len, model=model, want_logprobs=False,
                             include_usage=False, on_done=done)
        return StreamingResponse(responses_events(events, response_skeleton(response_id, model, req), stored),
                                 media_type="text/event-stream")
    out = await run_turn(state, deps, chat, spec, ctx.max_model_len)
    await done(out)
    raise_if_failed(out)
    return JSONResponse(stored())
