"""OpenAI-compatible routes and sessions (data plane).

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

import contextlib
import json
import time
import uuid

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from asyncrl.http.errors import ApiError
from asyncrl.http.openapi import errors, streams
from rollout_service.agent.state import AgentState
from rollout_service.api.auth import bearer, check_token, hash_token, new_token, require_token
from rollout_service.api.limits import hold_until_sent
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import (
    answer_chat,
    answer_completion,
    chat_spec,
    check_chat_limits,
    check_completion,
    check_model,
    ephemeral_state,
    served_models,
)
from rollout_service.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    FinishRequest,
    RewardRequest,
    SessionCreate,
    ToolResultRequest,
)
from rollout_service.openai.sessions import (
    EXTERNAL_GROUP_PREFIX,
    SessionRecord,
    normalize_message,
    prepare_text_turn,
    prepare_turn,
    roll_back,
    snapshot,
    tools_key,
)
from rollout_service.runner.finish import to_trajectory


async def _released_after(body, release, abandoned=None):
    """A streaming body that releases the session lock however the stream ends (after the
    turn under way has been closed: the body is closed first). ``abandoned()`` runs first when
    the client went away before the turn was done (it undoes the partial turn)."""
    try:
        async with contextlib.aclosing(body) as pieces:
            async for piece in pieces:
                yield piece
    finally:
        if abandoned is not None:
            abandoned()
        release()


def build_openai_router(ctx: OpenAIContext) -> APIRouter:
    api_token = ctx.api_token
    router = APIRouter()

    def data_plane(request: Request) -> None:
        require_token(request, api_token, "API")

    def models_body() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(ctx.started_at),
                                            "owned_by": "asyncrl", "root": ctx.model_name,
                                            "max_model_len": ctx.max_model_len} for name in served_models(ctx)]}

    def chat_for(req: ChatCompletionRequest):
        tools = [t.model_dump() for t in req.tools] if req.tools else None
        key = tools_key(tools)
        return ctx.chats.get(key, tools), key

    # -- stateless ------------------------------------------------------------------------
    stateless, long_polls = ctx.stateless, ctx.long_polls

    async def limited(answer):
        """Run ``answer()`` in a stateless-request slot, held until the response is sent."""
        release = stateless.take()
        try:
            return hold_until_sent(await answer(), release)
        except BaseException:
            release()
            raise

    @router.get("/v1/models")
    async def models(request: Request):
        data_plane(request)
        return models_body()

    @router.post("/v1/chat/completions", responses={**streams(), **errors(404, 422, 503)})
    async def chat_completions(request: Request, req: ChatCompletionRequest):
        data_plane(request)
        check_model(ctx, req.model)
        check_chat_limits(ctx, req)
        messages = [m.to_template() for m in req.messages]
        chat, _ = chat_for(req)
        state = ephemeral_state(ctx, messages)
        state.token_ids = chat.prompt_ids(messages)
        state.prompt_length = state.turn_start = len(state.token_ids)
        spec = chat_spec(ctx, req, state.prompt_length)

        async def done(out) -> None:
            return None

        return await limited(lambda: answer_chat(ctx, state, chat, req, spec, done))

    @router.post("/v1/completions", responses={**streams(), **errors(404, 503)})
    async def completions(request: Request, req: CompletionRequest):
        data_plane(request)
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

    # -- sessions -----------------------------------------------------------------------
    sessions = ctx.sessions

    def session_for(request: Request, sid: str) -> SessionRecord:
        rec = sessions.get(sid)
        check_token(rec.token_hash, bearer(request))
        return rec

    def open_session(request: Request, sid: str) -> SessionRecord:
        rec = session_for(request, sid)
        if rec.status != "open":
            raise ApiError(409, f"session {sid} is {rec.status}", param="session_id")
        return rec

    @router.post("/v1/sessions", status_code=201, responses=errors(409, 429, 503))
    async def create_session(request: Request, body: SessionCreate | None = None):
        data_plane(request)
        body = body or SessionCreate()
        size = len(json.dumps(body.metadata))
        if size > ctx.api.max_session_metadata_bytes:
            raise ApiError(400, f"metadata is {size} bytes of JSON (limit {ctx.api.max_session_metadata_bytes})",
                           param="metadata")
        if sessions.open_count >= ctx.api.max_sessions:
            raise ApiError(429, f"{sessions.open_count} sessions are open (limit {ctx.api.max_sessions})", headers={"Retry-After": "10"})
        sid = f"sess-{uuid.uuid4().hex[:20]}"
        named = body.group_id or f"g-{sid}"
        group_id = EXTERNAL_GROUP_PREFIX + named  # never one of the service's own groups (s00000001, ...)
        size = next((r.agent.group_size for r in sessions.sessions.values() if r.agent.group_id == group_id), None)
        if size is not None and size != body.group_size:
            raise ApiError(409, f"group {named!r} has group_size {size}, fixed by its first session", param="group_size")
        refused = ctx.runner.admit_external(group_id, body.group_size)
        if refused is not None:  # NATS not taking trajectories is an outage (503); quota, pause and the like are backpressure (429)
            status = 503 if refused.startswith("outbox full") else 429
            raise ApiError(status, f"not admitting new episodes now: {refused}", headers={"Retry-After": "5"})
        token = new_token()
        now = time.time()
        agent = AgentState(id=sid, run_id=ctx.run_id, group_id=group_id, group_size=body.group_size, group_index=body.group_index,
                           prompt_id=body.prompt_id or sid, data_source=body.data_source, ground_truth=body.ground_truth,
                           created_at=now)
        rec = SessionRecord(id=sid, token_hash=hash_token(token), agent=agent, created_at=now, last_activity=now, metadata=body.metadata)
        sessions.add(rec)
        await sessions.save(rec)
        root = (ctx.api.public_url or str(request.base_url)).rstrip("/")
        return {"id": sid, "token": token, "base_url": f"{root}/v1/sessions/{sid}/v1", "group_id": named,
                "expires_after_idle_s": ctx.api.session_ttl_s}

    @router.get("/v1/sessions/{sid}", responses=errors(404))
    async def get_session(request: Request, sid: str):
        return session_for(request, sid).public()

    @router.get("/v1/sessions/{sid}/v1/models", responses=errors(404))
    async def session_models(request: Request, sid: str):
        session_for(request, sid)
        return models_body()

    async def session_turn(sid: str, rec: SessionRecord, prepare, answer, on_success=None):
        """One session request under the session's lock (module doc of ``sessions``):
        ``prepare()`` extends the recorded tokens, ``answer(done)`` runs the turn and answers
        (a StreamingResponse or not) and awaits ``done(outcome)`` when the turn is over.
        A failed turn, an exception before the turn was done and a stream the client closed
        mid-turn all put the session back as it was; ``on_success(outcome)`` records the rest."""
        lock = sessions.lock(sid)
        await lock.acquire()
        released = completed = streaming = False
        before = snapshot(rec)

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                lock.release()

        async def done(out) -> None:
            nonlocal completed
            completed = True
            if out.finish_reason == "error":  # a failed request leaves the session as it was
                roll_back(rec, before)
            elif on_success is not None:
                on_success(out)
            rec.last_activity = time.time()
            await sessions.save(rec)

        def abandoned() -> None:
            # The client closed the stream mid-turn: drop the partial turn. The bucket still
            # holds the state saved at the end of the previous request, which is `before`.
            if not completed:
                roll_back(rec, before)
                sessions.abandoned_streams += 1

        try:
            rec.last_activity = time.time()
            prepare()
            response = await answer(done)
            if isinstance(response, StreamingResponse):
                response.body_iterator = _released_after(response.body_iterator, release, abandoned)
                streaming = True
            return response
        finally:
            if not streaming:
                if not completed:  # refused or raised before the turn was over
                    roll_back(rec, before)
                release()

    @router.post("/v1/sessions/{sid}/v1/chat/completions", responses={**streams(), **errors(404, 409, 422, 503)})
    async def session_chat(request: Request, sid: str, req: ChatCompletionRequest):
        rec = open_session(request, sid)
        check_model(ctx, req.model)
        check_chat_limits(ctx, req)
        messages = [m.to_template() for m in req.messages]
        chat, key = chat_for(req)

        def recorded(out) -> None:
            assistant = {"role": "assistant", "content": out.content or ""}
            if out.tool_calls:
                assistant["tool_calls"] = out.tool_calls
            rec.known_messages.append(normalize_message(assistant))
            rec.agent.messages = [*messages, assistant]
            rec.last_turn_ended = out.ended_by_eos

        async def answer(done):
            spec = chat_spec(ctx, req, len(rec.agent.token_ids))
            return await answer_chat(ctx, rec.agent, chat, req, spec, done, {"session_id": sid, "segments": rec.segments})

        return await session_turn(sid, rec, lambda: prepare_turn(rec, messages, chat, key), answer, recorded)

    @router.post("/v1/sessions/{sid}/v1/completions", responses={**streams(), **errors(404, 409, 503)})
    async def session_completion(request: Request, sid: str, req: CompletionRequest):
        rec = open_session(request, sid)
        check_model(ctx, req.model)
        chat = ctx.chats.get("", None)
        ids = list(req.prompt) if isinstance(req.prompt, list) else chat.encode_text(req.prompt)
        check_completion(ctx, chat, req, ids)  # refused before the session's tokens are touched
        return await session_turn(sid, rec, lambda: prepare_text_turn(rec, ids),
                                  lambda done: answer_completion(ctx, rec.agent, chat, req, ids, done))

    @router.post("/v1/sessions/{sid}/reward", responses=errors(404, 409))
    async def set_reward(request: Request, sid: str, body: RewardRequest):
        rec = open_session(request, sid)
        rec.agent.reward = body.total
        rec.agent.reward_details = dict(body.components or {})
        rec.reward_set = True
        rec.last_activity = time.time()
        await sessions.save(rec)
        return rec.public()

    @router.post("/v1/sessions/{sid}/finish", responses=errors(404, 409))
    async def finish(request: Request, sid: str, body: FinishRequest | None = None):
        rec = session_for(request, sid)
        if rec.status in ("finished", "failed"):
            return rec.public()
        if rec.status != "open":
            raise ApiError(409, f"session {sid} is {rec.status}", param="session_id")
        failure = body.failure if body is not None else ""
        async with sessions.lock(sid):
            a = rec.agent
            if a.response_length <= 0 or not any(a.loss_mask):
                if not failure:
                    raise ApiError(409, "the session has no completion to publish", param="session_id")
                # nothing to publish: closed as failed, its place in the group given back
                rec.status, rec.finished_at = "failed", time.time()
                rec.metadata["failure"] = {"failure": failure, "error": body.error}
                await ctx.runner.drop_member(a.group_id)
                await sessions.save(rec)
                return rec.public()
            a.finish_reason = "stop"
            if failure:
                a.failure = failure
                a.reward_details = {**a.reward_details, "error": body.error}
            traj = to_trajectory(a, ctx.runner.version)
            traj.metadata.update({"session": True, "segments": rec.segments, "divergences": rec.divergences,
                                  "reward_set": rec.reward_set, **{f"user_{k}": v for k, v in rec.metadata.items()}})
            await ctx.runner.enqueue(traj)
            rec.status = "finished"
            rec.finished_at = time.time()
            await sessions.save(rec)
        return rec.public()

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
            data_plane(request)
        calls = await polled(lambda w: broker.pending(environment=env, wait_s=w), wait)
        return {"environment": env, "tool_calls": calls}

    return router
