"""OpenAI response objects (chat.completion, chat.completion.chunk, text_completion)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from rollout_service.openai.token_bytes import token_bytes
from rollout_service.openai.turns import TurnOutcome


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def token_text(tok, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tok, out: TurnOutcome) -> dict[str, Any]:
    content = []
    for i, (tid, lp) in enumerate(zip(out.model_ids, out.model_logprobs)):
        text = token_text(tok, tid)
        entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": token_bytes(tok, tid), "top_logprobs": []}
        if out.top_logprobs is not None and i < len(out.top_logprobs):
            entry["top_logprobs"] = [{"token": token_text(tok, a), "logprob": b, "bytes": token_bytes(tok, a)}
                                     for a, b in out.top_logprobs[i]]
        content.append(entry)
    return {"content": content, "refusal": None}


def usage(out: TurnOutcome) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def chat_completion(tok, model: str, out: TurnOutcome, want_logprobs: bool, extra: dict | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.tool_calls:
        message["tool_calls"] = out.tool_calls
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": out.finish_reason,
                     "logprobs": chat_logprobs(tok, out) if want_logprobs else None}],
        "usage": usage(out), **extension({"weight_version": out.weight_version, **(extra or {})}),
    }


def extension(facts: dict[str, Any]) -> dict[str, Any]:
    """asyncrl's facts about an answer, where OpenAI's client accepts them: ``metadata`` (typed
    string → string by the official client: every value as a string, None left out) and
    ``asyncrl`` (an extension field with the native types)."""
    return {"metadata": {k: str(v) for k, v in facts.items() if v is not None}, "asyncrl": dict(facts)}


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(cid: str, model: str, delta: dict, finish_reason: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def text_completion(tok, model: str, out: TurnOutcome, logprobs_k: int | None) -> dict[str, Any]:
    lp = None
    if logprobs_k is not None:
        tokens = [token_text(tok, t) for t in out.model_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = None
        if out.top_logprobs is not None:
            tops = [{token_text(tok, a): b for a, b in row} for row in out.top_logprobs]
        lp = {"tokens": tokens, "token_logprobs": out.model_logprobs, "top_logprobs": tops, "text_offset": offsets}
    return {
        "id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason if out.finish_reason != "tool_calls" else "stop"}],
        "usage": usage(out), **extension({"weight_version": out.weight_version}),
    }
