"""OpenAI-compatible routes and sessions (data plane), one router per concern:
:mod:`.routes_stateless`, :mod:`.routes_sessions`, :mod:`.routes_tools`.

Stateless (bearer ``security.api_token`` when set): ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions`` — inference through the run's
engines, not recorded.

Sessions (episodes that become training data, see :mod:`.sessions`):
``POST /v1/sessions`` (data-plane token) → ``{id, token, base_url}``; with the session token:
``GET /v1/sessions/{id}``, ``POST /v1/sessions/{id}/v1/chat/completions`` (and
``/v1/completions``, ``/v1/models``: ``base_url`` works with any OpenAI client),
``POST /v1/sessions/{id}/reward``, ``POST /v1/sessions/{id}/finish``.

External environments (they answer the calls parked on the broker,
:mod:`rollout_service.agent.external_tools`): ``GET /v1/sessions/{id}/tool_calls?wait=``
and ``POST /v1/sessions/{id}/tool_results`` (the call's token), and
``GET /v1/environments/{env}/tool_calls?wait=`` (data-plane token).
"""

from __future__ import annotations

from fastapi import APIRouter

from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.routes_sessions import sessions_router
from rollout_service.openai.routes_stateless import stateless_router
from rollout_service.openai.routes_tools import external_tools_router


def build_openai_router(ctx: OpenAIContext) -> APIRouter:
    """Every OpenAI-compatible route: one router per concern (issue 50 item 5)."""
    router = APIRouter()
    for part in (stateless_router(ctx), sessions_router(ctx), external_tools_router(ctx)):
        router.include_router(part)
    return router
