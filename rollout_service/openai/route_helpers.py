"""What the OpenAI routers share: the data-plane check, the models list, the chat template
for a request's tools."""

from __future__ import annotations

from fastapi import Request

from rollout_service.api.auth import require_token
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import served_models
from rollout_service.openai.schemas import ChatCompletionRequest
from rollout_service.openai.sessions import tools_key


def data_plane(ctx: OpenAIContext, request: Request) -> None:
    """Refuse a request without the data-plane token (when one is set; a bearer token or an
    ``x-api-key`` header)."""
    require_token(request, ctx.api_token, "API", api_key_header=True)


def models_body(ctx: OpenAIContext) -> dict:
    """``GET /v1/models``' answer."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(ctx.started_at),
                                        "owned_by": "asyncrl", "root": ctx.model_name,
                                        "max_model_len": ctx.max_model_len} for name in served_models(ctx)]}


def chat_for(ctx: OpenAIContext, req: ChatCompletionRequest):
    """The chat template for the request's tools, and its cache key."""
    tools = [t.model_dump() for t in req.tools] if req.tools else None
    key = tools_key(tools)
    return ctx.chats.get(key, tools), key
