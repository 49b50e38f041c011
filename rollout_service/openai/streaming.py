"""Streaming one assistant turn as OpenAI ``chat.completion.chunk`` server-sent events.

Tokens are streamed from the engine (SGLang's cumulative SSE) and turned into text deltas:
text is decoded up to the newest token and only the new suffix is sent, holding back an
incomplete UTF-8 character or a possible start of ``<tool_call>``. Once a tool call begins,
content deltas stop; the parsed calls are sent in one ``tool_calls`` delta at the end, then
the finish reason, then (``stream_options.include_usage``) a usage chunk, then ``[DONE]``.
A pause for a weight sync aborts the engine request; the stream waits for the resume and
continues from the tokens already produced (the client just sees a gap).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from asyncrl.engine_client.errors import EngineError
from asyncrl.engine_client.types import GenerateResult
from rollout_service.agent.chat import ChatTokenizer
from rollout_service.agent.loop import AgentDeps, append_model_tokens, sampling_params, turn_budget
from rollout_service.agent.state import AgentState
from rollout_service.openai.responses import chat_logprobs, chunk, new_id, sse, usage
from rollout_service.openai.turns import (
    TurnOutcome,
    TurnSpec,
    append_forced_prefix,
    describe_turn,
    turn_deps,
)

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


async def stream_turn(state: AgentState, base: AgentDeps, chat: ChatTokenizer, spec: TurnSpec, budget: int, *,
                      pool, tracking, model: str, want_logprobs: bool, include_usage: bool,
                      on_done: Callable[[TurnOutcome], Awaitable[None]], kind: str = "chat") -> AsyncIterator[bytes]:
    """SSE bytes of one turn; ``kind`` is ``chat`` (chat.completion.chunk) or ``text`` (text_completion)."""
    text_mode = kind == "text"
    cid = new_id("cmpl" if text_mode else "chatcmpl")
    if not text_mode:
        yield sse(chunk(cid, model, {"role": "assistant", "content": ""}))
    prompt_tokens = len(state.token_ids)
    append_forced_prefix(state, chat, spec)
    deps, _rec = turn_deps(base, chat, spec, budget)
    tools_enabled = spec.tool_choice != "none"
    sent = 0
    results: list[GenerateResult] = []
    extra = {"top_logprobs_num": spec.top_logprobs} if spec.top_logprobs else None
    ended: bool | None = False
    while True:
        await deps.gate.wait_open()
        max_new = turn_budget(state, deps)
        if max_new <= 0:
            break
        rid = f"{deps.rid_prefix}{state.id}.t{state.assistant_turns}.s{state.segment}"
        final: GenerateResult | None = None
        seen_ids = 0
        t0 = time.monotonic()
        try:
            with tracking():
                async for res in pool.generate_stream(state, state.token_ids, sampling_params(deps, max_new), rid, extra):
                    final = res
                    text = chat.decode_turn(state.token_ids[state.turn_start:] + res.output_ids)
                    visible = _safe_cut(text, tools_enabled)
                    new_ids = res.output_ids[seen_ids:]
                    lp = None
                    if want_logprobs and new_ids:
                        part = TurnOutcome("", None, [], "", new_ids, (res.logprobs or [])[seen_ids:], None, None, False, 0, 0)
                        lp = chat_logprobs(chat.tok, part)
                    seen_ids = len(res.output_ids)
                    if len(visible) > sent or (lp and not text_mode):
                        if text_mode:
                            yield sse(_text_chunk(cid, model, visible[sent:]))
                        else:
                            yield sse(chunk(cid, model, {"content": visible[sent:]}, logprobs=lp))
                        sent = max(sent, len(visible))
        except EngineError as exc:
            yield sse({"error": {"message": f"engine error: {exc}", "type": "server_error", "code": 502}})
            ended = None
            break
        finally:
            state.add_timing("generate", time.monotonic() - t0)
        if final is None:
            ended = None
            break
        append_model_tokens(state, final, deps)
        results.append(final)
        if final.aborted:
            state.segment += 1
            state.resumed_after_abort += 1
            continue
        ended = final.finish_reason.type == "stop" and bool(final.output_ids) and final.output_ids[-1] == chat.eos_token_id
        break
    out = describe_turn(state, chat, spec, ended, results, prompt_tokens)
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
