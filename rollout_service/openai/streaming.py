"""Streaming one assistant turn as OpenAI ``chat.completion.chunk`` (or ``text_completion``)
server-sent events.

The turn is the agents' one turn loop (:func:`~rollout_service.openai.turns.run_turn` with
an ``on_chunk`` hook), run as a task; this module only turns the engine's cumulative results
into SSE deltas: text is decoded up to the newest token and only the new suffix is sent,
holding back an incomplete UTF-8 character or a possible start of ``<tool_call>``. Once a
tool call begins, content deltas stop; the parsed calls are sent in one ``tool_calls`` delta
at the end, then the finish reason, then (``stream_options.include_usage``) a usage chunk,
then ``[DONE]``.

Because the loop is shared, a streamed turn behaves like a non-streamed one: a pause for a
weight sync aborts the engine request and the stream continues from the tokens already
produced after the resume (the client just sees a gap); an engine failure is retried on
another engine, continuing after the tokens already sent. Only when the retries run out
does the stream carry an ``error`` event (then ``finish_reason: "error"``).

Limits: deltas wait in an in-memory queue while the client reads slowly; there is at most
one per engine chunk, so at most ``max_tokens`` of them. Closing the stream (client gone)
cancels the turn, which closes the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from asyncrl.chat import ChatTokenizer
from asyncrl.engine_client.types import GenerateResult
from asyncrl.http.errors import error_type
from rollout_service.agent.deps import AgentDeps
from rollout_service.agent.state import AgentState
from rollout_service.openai.responses import chat_logprobs, chunk, new_id, sse, usage
from rollout_service.openai.turns import TurnOutcome, TurnSpec, run_turn

TOOL_MARK = "<tool_call>"


def _safe_cut(text: str, tools_enabled: bool) -> str:
    """The prefix of ``text`` that can be sent now."""
    if tools_enabled and TOOL_MARK in text:
        return text[: text.index(TOOL_MARK)]
    cut = len(text)
    if text.endswith("\ufffd"):
        cut -= 1
    if tools_enabled:
        for k in range(min(len(TOOL_MARK) - 1, cut), 0, -1):
            if TOOL_MARK.startswith(text[cut - k:cut]):
                cut -= k
                break
    return text[:cut]


def _text_chunk(cid: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


class _Deltas:
    """What the client has been sent of the turn so far, and the next delta to send."""

    def __init__(self, state: AgentState, chat: ChatTokenizer, cid: str, model: str, *, text_mode: bool,
                 tools_enabled: bool, want_logprobs: bool) -> None:
        self.state, self.chat, self.cid, self.model = state, chat, cid, model
        self.text_mode, self.tools_enabled, self.want_logprobs = text_mode, tools_enabled, want_logprobs
        self.sent = 0
        """Characters of the turn's text sent."""
        self.tokens_seen: int | None = None
        """Length of the sequence (kept tokens + the current result) whose logprobs were sent."""

    def feed(self, res: GenerateResult) -> bytes | None:
        """The SSE event for a cumulative result (not yet appended to the state), or None."""
        state, chat = self.state, self.chat
        base = len(state.token_ids)
        if self.tokens_seen is None:
            self.tokens_seen = base
        text = chat.decode_turn(state.token_ids[state.turn_start:] + res.output_ids)
        visible = _safe_cut(text, self.tools_enabled)
        seen = max(0, self.tokens_seen - base)
        new_ids = res.output_ids[seen:]
        lp = None
        if self.want_logprobs and new_ids:
            part = TurnOutcome("", None, [], "", new_ids, (res.logprobs or [])[seen:], None, None, False, 0, 0)
            lp = chat_logprobs(chat.tok, part)
        self.tokens_seen = base + len(res.output_ids)
        if not (len(visible) > self.sent or (lp and not self.text_mode)):
            return None
        if self.text_mode:
            event = sse(_text_chunk(self.cid, self.model, visible[self.sent:]))
        else:
            event = sse(chunk(self.cid, self.model, {"content": visible[self.sent:]}, logprobs=lp))
        self.sent = max(self.sent, len(visible))
        return event


async def stream_turn(state: AgentState, base: AgentDeps, chat: ChatTokenizer, spec: TurnSpec, budget: int, *,
                      model: str, want_logprobs: bool, include_usage: bool,
                      on_done: Callable[[TurnOutcome], Awaitable[None]], kind: str = "chat") -> AsyncIterator[bytes]:
    """SSE bytes of one turn; ``kind`` is ``chat`` (chat.completion.chunk) or ``text`` (text_completion)."""
    text_mode = kind == "text"
    cid = new_id("cmpl" if text_mode else "chatcmpl")
    if not text_mode:
        yield sse(chunk(cid, model, {"role": "assistant", "content": ""}))
    tools_enabled = spec.tool_choice != "none"
    deltas = _Deltas(state, chat, cid, model, text_mode=text_mode, tools_enabled=tools_enabled, want_logprobs=want_logprobs)
    events: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def on_chunk(res: GenerateResult) -> None:
        event = deltas.feed(res)
        if event is not None:
            events.put_nowait(event)

    turn = asyncio.create_task(run_turn(state, base, chat, spec, budget, on_chunk=on_chunk), name=f"stream-{state.id}")
    turn.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield event
        out = turn.result()
    finally:
        if not turn.done():
            turn.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await turn
    sent = deltas.sent
    if out.finish_reason == "error":  # an error event ends the stream: no finish chunk ("error" is not OpenAI's)
        err = out.error
        status = 502 if err is None or err.status is None else err.status
        message = err.message if err is not None and err.code else f"engine error: {err.message if err else 'the engines failed'}"
        yield sse({"error": {"message": message, "type": error_type(status), "param": err.param if err else None,
                             "code": (err.code if err is not None and err.code else status)}})
        await on_done(out)
        yield b"data: [DONE]\n\n"
        return
    if text_mode:
        if len(out.text) > sent:
            yield sse(_text_chunk(cid, model, out.text[sent:]))
        yield sse(_text_chunk(cid, model, "", out.finish_reason if out.finish_reason != "tool_calls" else "stop"))
        if include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                       "choices": [], "usage": usage(out)})
        await on_done(out)
        yield b"data: [DONE]\n\n"
        return
    if out.tool_calls:
        delta_calls = [{"index": i, **call} for i, call in enumerate(out.tool_calls)]
        yield sse(chunk(cid, model, {"tool_calls": delta_calls}))
    elif out.content is not None and len(out.content) > sent and not tools_enabled:
        yield sse(chunk(cid, model, {"content": out.content[sent:]}))
    elif out.content and TOOL_MARK not in out.text and len(out.text) > sent:
        yield sse(chunk(cid, model, {"content": out.text[sent:]}))
    yield sse(chunk(cid, model, {}, finish_reason=out.finish_reason))
    if include_usage:
        yield sse({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                   "choices": [], "usage": usage(out)})
    await on_done(out)
    yield b"data: [DONE]\n\n"


def sse_objects(piece: bytes) -> list[dict[str, Any]]:
    """The JSON objects of a piece of this module's Chat stream (its ``data: {...}`` lines): what
    the Responses and Messages streams translate."""
    return [json.loads(line[6:]) for line in piece.split(b"\n") if line.startswith(b"data: {")]


class ContentDeltas:
    """The content deltas of this module's Chat stream, in order (``async for delta in ...``):
    what the Responses and Messages streams translate. An error chunk yields nothing; the last
    one is kept in ``error`` for the caller to report once the stream has ended. Closing the
    iteration (``contextlib.aclosing(aiter(deltas))``) closes the Chat stream at once, so the
    turn under way is cancelled before whoever closed it goes on (a session's lock released)."""

    def __init__(self, chat_stream: AsyncGenerator[bytes, None]) -> None:
        self.chat_stream = chat_stream
        self.error: dict[str, Any] | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        async with contextlib.aclosing(self.chat_stream) as pieces:
            async for piece in pieces:
                for obj in sse_objects(piece):
                    if "error" in obj:
                        self.error = obj["error"]
                        continue
                    for choice in obj.get("choices") or []:
                        if delta := (choice.get("delta") or {}).get("content"):
                            yield delta
