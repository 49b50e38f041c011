"""The external environments' routes: they answer the tool calls parked on the broker
(:mod:`rollout_service.agent.external_tools`). ``GET /v1/sessions/{id}/tool_calls?wait=`` and
``POST /v1/sessions/{id}/tool_results`` (the call's token), ``GET
/v1/environments/{env}/tool_calls?wait=`` (the environment's own token, else the data-plane
token). A long-poll holds a slot (``api.max_long_polls``) for at most ``api.poll_max_wait_s``."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from asyncrl.http.openapi import errors
from rollout_service.api.auth import bearer, require_token
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.route_helpers import data_plane
from rollout_service.openai.schemas import ToolResultRequest


def external_tools_router(ctx: OpenAIContext) -> APIRouter:
    router = APIRouter()
    long_polls = ctx.long_polls
    # -- external environments ----------------------------------------------------------
    broker = ctx.broker

    async def polled(pending, wait: float):
        """``pending(wait_s)``: a long-poll (wait > 0) in a long-poll slot."""
        wait = min(wait, ctx.api.poll_max_wait_s)
        if wait <= 0:
            return await pending(0.0)
        release = long_polls.take()
        try:
            return await pending(wait)
        finally:
            release()

    @router.get("/v1/sessions/{sid}/tool_calls", responses=errors(404))
    async def session_tool_calls(request: Request, sid: str, wait: float = Query(0.0, ge=0.0)):
        broker.authorize(sid, bearer(request))
        calls = await polled(lambda w: broker.pending(session_id=sid, wait_s=w), wait)
        return {"session_id": sid, "tool_calls": [{k: v for k, v in c.items() if k != "token"} for c in calls]}

    @router.post("/v1/sessions/{sid}/tool_results", responses=errors(404, 409))
    async def tool_result(request: Request, sid: str, body: ToolResultRequest):
        return await broker.post_result(sid, body.tool_call_id, body.content, body.is_error, bearer(request))

    environment_tokens = ctx.environment_tokens

    @router.get("/v1/environments/{env}/tool_calls")
    async def environment_tool_calls(request: Request, env: str, wait: float = Query(0.0, ge=0.0)):
        if env in environment_tokens:  # scoped: this environment's token only, not the data plane's
            require_token(request, environment_tokens[env], f"environment {env!r}")
        else:
            data_plane(ctx, request)
        calls = await polled(lambda w: broker.pending(environment=env, wait_s=w), wait)
        return {"environment": env, "tool_calls": calls}

    return router
