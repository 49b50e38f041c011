"""The stateless OpenAI routes (bearer ``security.api_token`` when set): ``GET /v1/models``,
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``, ``POST /v1/messages``
(Anthropic's): inference through the run's engines,
not recorded; each held in a stateless-request slot until its answer is sent
(``api.max_stateless_requests``)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from asyncrl.http.errors import ApiError
from asyncrl.http.openapi import errors, streams
from rollout_service.api.limits import hold_until_sent
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import (
    answer_chat,
    answer_completion,
    chat_spec,
    check_chat_limits,
    check_model,
    ephemeral_state,
)
from rollout_service.openai.messages_answer import answer_message
from rollout_service.openai.messages_request import MessagesRequest, lower_messages
from rollout_service.openai.responses_answer import answer_response
from rollout_service.openai.responses_objects import new_response_id, response_object
from rollout_service.openai.responses_request import ResponsesRequest, lower
from rollout_service.openai.route_helpers import chat_for, data_plane, models_body
from rollout_service.openai.schemas import ChatCompletionRequest, CompletionRequest


def stateless_router(ctx: OpenAIContext) -> APIRouter:
    router = APIRouter()
    # -- stateless ------------------------------------------------------------------------
    stateless = ctx.stateless

    async def limited(answer):
        """Run ``answer()`` in a stateless-request slot, held until the response is sent."""
        release = stateless.take()
        try:
            return hold_until_sent(await answer(), release)
        except BaseException:
            release()
            raise

    def prepared(req: ChatCompletionRequest):
        """The chat tokenizer, a not-recorded agent state holding the rendered prompt, and the
        turn's spec for a Chat request (or the one a Responses request was lowered to)."""
        check_chat_limits(ctx, req)
        messages = [m.to_template() for m in req.messages]
        chat, _ = chat_for(ctx, req)
        state = ephemeral_state(ctx, messages)
        state.token_ids = chat.prompt_ids(messages)
        state.prompt_length = state.turn_start = len(state.token_ids)
        return chat, state, chat_spec(ctx, req, state.prompt_length)

    @router.get("/v1/models")
    async def models(request: Request):
        data_plane(ctx, request)
        return models_body(ctx)

    @router.post("/v1/chat/completions", responses={**streams(), **errors(404, 422, 503)})
    async def chat_completions(request: Request, req: ChatCompletionRequest):
        data_plane(ctx, request)
        check_model(ctx, req.model)
        chat, state, spec = prepared(req)

        async def done(out) -> None:
            return None

        return await limited(lambda: answer_chat(ctx, state, chat, req, spec, done))

    @router.post("/v1/responses", responses={**streams(), **errors(400, 404, 422, 503)})
    async def responses(request: Request, req: ResponsesRequest):
        """The Responses API, not recorded and not stored (no ``previous_response_id``, no ``GET``:
        use a session for those)."""
        data_plane(ctx, request)
        check_model(ctx, req.model)
        if req.previous_response_id is not None:
            raise ApiError(400, "previous_response_id needs a session: stateless responses are not stored",
                           param="previous_response_id")
        chat_req = lower(req)
        chat, state, spec = prepared(chat_req)
        response_id, box = new_response_id(), {}

        async def done(out) -> None:
            box["object"] = response_object(response_id, ctx.model_name, req, out)

        return await limited(lambda: answer_response(ctx, state, chat, req, spec, response_id, done, lambda: box.get("object")))

    @router.post("/v1/messages", responses={**streams(), **errors(400, 404, 422, 503)})
    async def messages(request: Request, req: MessagesRequest):
        """Anthropic's Messages API, not recorded (``x-api-key`` or a bearer token)."""
        data_plane(ctx, request)
        check_model(ctx, req.model)
        chat, state, spec = prepared(lower_messages(req, ctx.api.max_tokens))

        async def done(out) -> None:
            return None

        return await limited(lambda: answer_message(ctx, state, chat, req, spec, done, fresh_ids=True))

    @router.post("/v1/completions", responses={**streams(), **errors(404, 503)})
    async def completions(request: Request, req: CompletionRequest):
        data_plane(ctx, request)
        check_model(ctx, req.model)
        chat = ctx.chats.get("", None)
        ids = list(req.prompt) if isinstance(req.prompt, list) else chat.encode_text(req.prompt)
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        state = ephemeral_state(ctx, [])
        state.token_ids, state.prompt_length, state.turn_start = list(ids), len(ids), len(ids)

        async def done(out) -> None:
            return None

        return await limited(lambda: answer_completion(ctx, state, chat, req, ids, done))

    return router
