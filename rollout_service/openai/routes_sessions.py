"""The session routes: episodes an external agent drives that become training data
(:mod:`.sessions`). ``POST /v1/sessions`` (data-plane token) → ``{id, token, base_url}``; with
the session token: ``GET /v1/sessions/{id}``, ``POST /v1/sessions/{id}/v1/chat/completions``
(and ``/v1/completions``, ``/v1/models``: ``base_url`` works with any OpenAI client),
``POST /v1/sessions/{id}/v1/responses`` (the Responses API), ``POST /v1/sessions/{id}/v1/messages``
(Anthropic Messages: ``base_url`` without its ``/v1`` for an Anthropic client),
``POST /v1/sessions/{id}/reward``, ``POST /v1/sessions/{id}/finish`` (publishes the
trajectory). Each turn runs under the session's lock; a failed, refused or abandoned turn puts
the session back as it was."""

from __future__ import annotations

import contextlib
import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from asyncrl.http.errors import ApiError
from asyncrl.http.openapi import errors, streams
from asyncrl.http.session_tokens import check_token, hash_token, new_token
from rollout_service.agent.state import AgentState
from rollout_service.api.auth import client_key
from rollout_service.openai.context import OpenAIContext
from rollout_service.openai.handlers import (
    answer_chat,
    answer_completion,
    chat_spec,
    check_chat_limits,
    check_completion,
    check_model,
)
from rollout_service.openai.messages_answer import answer_message
from rollout_service.openai.messages_request import MessagesRequest, lower_messages
from rollout_service.openai.responses_answer import answer_response
from rollout_service.openai.responses_history import conversation, remember
from rollout_service.openai.responses_objects import new_response_id, response_object
from rollout_service.openai.responses_request import ResponsesRequest, lower
from rollout_service.openai.route_helpers import chat_for, data_plane, models_body
from rollout_service.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    FinishRequest,
    RewardRequest,
    SessionCreate,
)
from rollout_service.openai.sessions import (
    EXTERNAL_GROUP_PREFIX,
    SessionRecord,
    prepare_text_turn,
    prepare_turn,
    record_turn,
    roll_back,
    snapshot,
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


def sessions_router(ctx: OpenAIContext) -> APIRouter:
    router = APIRouter()
    # -- sessions -----------------------------------------------------------------------
    sessions = ctx.sessions

    def session_for(request: Request, sid: str) -> SessionRecord:
        rec = sessions.get(sid)
        check_token(rec.token_hash, client_key(request))
        return rec

    def open_session(request: Request, sid: str) -> SessionRecord:
        rec = session_for(request, sid)
        if rec.status != "open":
            raise ApiError(409, f"session {sid} is {rec.status}", param="session_id")
        return rec

    @router.post("/v1/sessions", status_code=201, responses=errors(409, 429, 503))
    async def create_session(request: Request, body: SessionCreate | None = None):
        data_plane(ctx, request)
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
        members = [r for r in sessions.sessions.values() if r.agent.group_id == group_id]
        size = members[0].agent.group_size if members else None
        if size is not None and size != body.group_size:
            raise ApiError(409, f"group {named!r} has group_size {size}, fixed by its first session", param="group_size")
        refused = ctx.runner.admit_external(group_id, body.group_size, recorded_members=len(members))
        if refused is not None:
            status, why = refused
            if status == 409:
                raise ApiError(409, f"group {named!r} is full: {why}; start a new group", param="group_id")
            raise ApiError(status, f"not admitting new episodes now: {why}", headers={"Retry-After": "5"})
        token = new_token()
        now = time.time()
        agent = AgentState(id=sid, run_id=ctx.run_id, group_id=group_id, group_size=body.group_size, group_index=body.group_index,
                           prompt_id=body.prompt_id or sid, data_source=body.data_source, ground_truth=body.ground_truth,
                           created_at=now)
        rec = SessionRecord(id=sid, token_hash=hash_token(token), agent=agent, created_at=now, last_activity=now, metadata=body.metadata)
        sessions.add(rec)
        await sessions.save(rec)
        root = (ctx.api.public_url or str(request.base_url)).rstrip("/")
        return {"id": sid, "token": token, "base_url": f"{root}/v1/sessions/{sid}/v1",
                "anthropic_base_url": f"{root}/v1/sessions/{sid}", "group_id": named,
                "expires_after_idle_s": ctx.api.session_ttl_s}

    @router.get("/v1/sessions/{sid}", responses=errors(404))
    async def get_session(request: Request, sid: str):
        return session_for(request, sid).public()

    @router.get("/v1/sessions/{sid}/v1/models", responses=errors(404))
    async def session_models(request: Request, sid: str):
        session_for(request, sid)
        return models_body(ctx)

    async def session_turn(sid: str, rec: SessionRecord, prepare, answer, on_success=None, incoming: int = 0,
                           stores_response: bool = False):
        """One session request under the session's lock (module doc of ``sessions``):
        ``prepare()`` extends the recorded tokens, ``answer(done)`` runs the turn and answers
        (a StreamingResponse or not) and awaits ``done(outcome)`` when the turn is over.
        A failed turn, an exception before the turn was done and a stream the client closed
        mid-turn all put the session back as it was; ``on_success(outcome)`` records the rest.
        A turn the session's record could not keep is refused first (``SessionManager.check_room``:
        ``incoming`` request bytes, ``stores_response``)."""
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
            sessions.check_room(rec, ctx.api, incoming, stores_response)
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
        chat, key = chat_for(ctx, req)

        def recorded(out) -> None:
            record_turn(rec, messages, out)

        async def answer(done):
            spec = chat_spec(ctx, req, len(rec.agent.token_ids))
            return await answer_chat(ctx, rec.agent, chat, req, spec, done, {"session_id": sid, "segments": rec.segments})

        return await session_turn(sid, rec, lambda: prepare_turn(rec, messages, chat, key), answer, recorded)

    @router.post("/v1/sessions/{sid}/v1/responses", responses={**streams(), **errors(400, 404, 409, 422, 503)})
    async def session_responses(request: Request, sid: str, req: ResponsesRequest):
        """The Responses API on the session (:mod:`.responses_request`): lowered onto the Chat
        turn, answered as a ``response`` object, kept for ``previous_response_id`` and ``GET``."""
        rec = open_session(request, sid)
        check_model(ctx, req.model)
        previous = None
        if req.previous_response_id is not None:
            previous = conversation(rec.responses, req.previous_response_id)
            if previous is None:
                raise ApiError(400, f"previous_response_id {req.previous_response_id!r} is not a response of this session",
                               param="previous_response_id")
        chat_req = lower(req, previous)
        check_chat_limits(ctx, chat_req)
        messages = [m.to_template() for m in chat_req.messages]
        chat, key = chat_for(ctx, chat_req)
        response_id = new_response_id()

        answered: dict = {}

        def recorded(out) -> None:
            assistant = record_turn(rec, messages, out)
            answered["object"] = response_object(response_id, ctx.model_name, req, out, {"session_id": sid, "segments": rec.segments})
            if req.store is False:  # not kept: no GET, no previous_response_id naming it (as OpenAI's store=false)
                return
            new_input = messages[(1 if req.instructions else 0) + len(previous or []):]
            remember(rec.responses, response_id, req.previous_response_id, new_input, assistant, answered["object"])

        async def answer(done):
            spec = chat_spec(ctx, chat_req, len(rec.agent.token_ids))
            return await answer_response(ctx, rec.agent, chat, req, spec, response_id, done, lambda: answered.get("object"))

        return await session_turn(sid, rec, lambda: prepare_turn(rec, messages, chat, key), answer, recorded,
                                  incoming=len(await request.body()), stores_response=req.store is not False)

    @router.post("/v1/sessions/{sid}/v1/messages", responses={**streams(), **errors(400, 404, 409, 422, 503)})
    async def session_messages(request: Request, sid: str, req: MessagesRequest):
        """Anthropic's Messages API on the session (:mod:`.messages_request`): lowered onto the
        Chat turn, answered as a ``message`` (errors in Anthropic's shape: :mod:`.messages_errors`)."""
        rec = open_session(request, sid)
        check_model(ctx, req.model)
        chat_req = lower_messages(req, ctx.api.max_tokens)
        check_chat_limits(ctx, chat_req)
        messages = [m.to_template() for m in chat_req.messages]
        chat, key = chat_for(ctx, chat_req)

        async def answer(done):
            spec = chat_spec(ctx, chat_req, len(rec.agent.token_ids))
            return await answer_message(ctx, rec.agent, chat, req, spec, done, {"session_id": sid, "segments": rec.segments})

        return await session_turn(sid, rec, lambda: prepare_turn(rec, messages, chat, key), answer,
                                  lambda out: record_turn(rec, messages, out))

    @router.get("/v1/sessions/{sid}/v1/responses/{response_id}", responses=errors(404))
    async def session_response(request: Request, sid: str, response_id: str):
        rec = session_for(request, sid)
        stored = rec.responses.get(response_id)
        if stored is None:
            raise ApiError(404, f"no response {response_id!r} in session {sid}", param="response_id")
        return stored.object

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
        failure = body.failure if body is not None else ""
        async with sessions.lock(sid):  # the status read under the lock: two /finish calls end it once (issue 67 L4)
            if rec.status in ("finished", "failed"):
                return rec.public()
            if rec.status != "open":
                raise ApiError(409, f"session {sid} is {rec.status}", param="session_id")
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

    return router
