"""Shared handling of chat and text completions for the stateless routes and sessions."""

from __future__ import annotations

import uuid
from pathlib import PurePosixPath
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.chat import ChatTokenizer
from asyncrl.http.errors import ApiError
from rollout_service.agent.state import AgentState, Phase
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.responses import chat_completion, text_completion
from rollout_service.openai.schemas import ChatCompletionRequest, CompletionRequest
from rollout_service.openai.streaming import stream_turn
from rollout_service.openai.turns import TurnOutcome, TurnSpec, run_turn


def served_model_name(api, model) -> str:
    """The model id clients see (from the ``api`` and ``model`` sections): ``api.model_name``,
    else the last component of ``model.path`` (a builtin spec such as ``builtin:tiny`` as it
    is). The path itself is never shown: where the weights lie on the server is not the
    clients' business (issue 30)."""
    if api.model_name:
        return api.model_name
    path = model.path.rstrip("/")
    return path if ":" in path.split("/")[0] else PurePosixPath(path).name or path


def served_models(ctx: OpenAIContext) -> list[str]:
    """The ids ``/v1/models`` lists: :func:`served_model_name` and ``api.model_aliases``."""
    return [ctx.model_name, *(a for a in ctx.api.model_aliases if a != ctx.model_name)]


def check_model(ctx: OpenAIContext, model: str | None) -> None:
    """OpenAI's answer to an unknown model: 404 ``model_not_found`` (unless ``api.accept_any_model``).
    ``model.path`` is accepted too, unlisted (what clients sent before the name was shortened)."""
    if model is None or ctx.api.accept_any_model or model in served_models(ctx) or model == ctx.model_path:
        return
    raise ApiError(404, f"The model `{model}` does not exist; this service serves {', '.join(served_models(ctx))}",
                   param="model", code="model_not_found")


def check_chat_limits(ctx: OpenAIContext, req: ChatCompletionRequest) -> None:
    """Bounds checked before any tokenisation."""
    api = ctx.api
    if len(req.messages) > api.max_messages:
        raise ApiError(400, f"{len(req.messages)} messages exceed the limit of {api.max_messages}", param="messages")
    want = req.requested_max_tokens
    if want is not None and want > api.max_tokens:
        raise ApiError(400, f"max_tokens {want} exceeds the limit of {api.max_tokens}", param="max_tokens")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs requires logprobs: true", param="top_logprobs")


def context_length_exceeded(prompt_len: int, limit: int, param: str) -> ApiError:
    """OpenAI's answer to a prompt that leaves no room to generate: 400 with code
    ``context_length_exceeded`` and its wording, which clients (verifiers among them) read
    as "the episode ran out of context" rather than as a failure."""
    return ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} tokens "
                         "and leaves no room for a completion", param=param, code="context_length_exceeded")


def chat_spec(ctx: OpenAIContext, req: ChatCompletionRequest, prompt_len: int) -> TurnSpec:
    room = ctx.max_model_len - prompt_len - 8
    if room <= 0:
        raise context_length_exceeded(prompt_len, ctx.max_model_len, "messages")
    want = req.requested_max_tokens or min(ctx.api.max_tokens, room)
    choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else (req.tool_choice or "auto")
    if isinstance(choice, dict):
        names = {t.function.name for t in req.tools or []}
        if choice.get("function", {}).get("name") not in names:
            raise ApiError(400, "tool_choice names a function that is not in tools", param="tool_choice")
    if choice == "required" and not req.tools:
        raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return TurnSpec(temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p or 1.0,
                    max_new_tokens=max(1, min(want, room)), stop=stops, seed=req.seed,
                    top_logprobs=req.top_logprobs or 0 if req.logprobs else 0, tool_choice=choice,
                    parallel_tool_calls=req.parallel_tool_calls is not False)


def ephemeral_state(ctx: OpenAIContext, messages: list[dict]) -> AgentState:
    return AgentState(id=f"api-{uuid.uuid4().hex[:16]}", run_id=ctx.run_id, group_id="api", group_size=1, group_index=0,
                      prompt_id="api", data_source="api", messages=messages, phase=Phase.GENERATING)


def raise_if_failed(out: TurnOutcome) -> None:
    """A failed turn is never a 200: the engine's own 4xx (the request's fault) is a 400 with its
    message; an unmet ``tool_choice`` a 422 ``tool_choice_not_satisfied``; the engines failing
    a 503 with Retry-After."""
    err = out.error
    if out.finish_reason != "error" or err is None:
        return
    if err.status is None:
        raise ApiError(503, "the engines failed to generate; try again", headers={"Retry-After": "5"})
    extra = {"code": err.code} if err.code else {}
    raise ApiError(400 if 400 <= err.status < 500 and err.status != 422 else err.status, err.message, param=err.param, **extra)


def check_completion(ctx: OpenAIContext, chat: ChatTokenizer, req: CompletionRequest, prompt_ids: list[int]) -> None:
    """Everything about a text completion that can be refused before a token is generated (or a
    session's recorded tokens are touched)."""
    api = ctx.api
    if not prompt_ids:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if req.max_tokens and req.max_tokens > api.max_tokens:
        raise ApiError(400, f"max_tokens {req.max_tokens} exceeds the limit of {api.max_tokens}", param="max_tokens")
    vocab = len(chat.tok)
    if any(t >= vocab for t in prompt_ids):
        raise ApiError(400, f"prompt token ids must be < vocabulary size {vocab}", param="prompt")
    if ctx.max_model_len - len(prompt_ids) - 1 <= 0:
        raise context_length_exceeded(len(prompt_ids), ctx.max_model_len, "prompt")


async def answer_chat(ctx: OpenAIContext, state: AgentState, chat: ChatTokenizer, req: ChatCompletionRequest, spec: TurnSpec,
                      on_done, extra_meta: dict[str, Any] | None = None):
    """Run the turn (streaming or not) and answer; ``on_done(outcome)`` runs after the turn."""
    deps = ctx.runner.deps
    model = ctx.model_name
    budget = ctx.max_model_len
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        gen = stream_turn(state, deps, chat, spec, budget, model=model, want_logprobs=bool(req.logprobs),
                          include_usage=include, on_done=on_done)
        return StreamingResponse(gen, media_type="text/event-stream")
    out: TurnOutcome = await run_turn(state, deps, chat, spec, budget)
    await on_done(out)
    raise_if_failed(out)
    return JSONResponse(chat_completion(chat.tok, model, out, bool(req.logprobs), extra_meta))


async def answer_completion(ctx: OpenAIContext, state: AgentState, chat: ChatTokenizer, req: CompletionRequest, prompt_ids: list[int], on_done):
    check_completion(ctx, chat, req, prompt_ids)
    room = ctx.max_model_len - len(prompt_ids) - 1
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    spec = TurnSpec(temperature=1.0 if req.temperature is None else req.temperature, top_p=req.top_p or 1.0,
                    max_new_tokens=min(req.max_tokens or 16, room), stop=stops, seed=req.seed,
                    top_logprobs=req.logprobs or 0, tool_choice="none")
    if req.stream:
        include = bool(req.stream_options and req.stream_options.include_usage)
        gen = stream_turn(state, ctx.runner.deps, chat, spec, ctx.max_model_len, model=ctx.model_name,
                          want_logprobs=False, include_usage=include, on_done=on_done, kind="text")
        return StreamingResponse(gen, media_type="text/event-stream")
    out = await run_turn(state, ctx.runner.deps, chat, spec, ctx.max_model_len)
    await on_done(out)
    raise_if_failed(out)
    return JSONResponse(text_completion(chat.tok, ctx.model_name, out, req.logprobs))
