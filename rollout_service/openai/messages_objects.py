"""Anthropic's ``message`` object for one turn (issue 52), built from the turn's
:class:`~rollout_service.openai.turns.TurnOutcome` — what ``POST .../v1/messages`` answers.

``content``: a ``text`` block with the turn's text when it has any, then one ``tool_use``
block per tool call (``id`` = the Chat tool call's id, which the client sends back as a
``tool_result``'s ``tool_use_id``; ``input`` = the parsed arguments). ``stop_reason``:
``tool_use`` with tool calls, ``max_tokens`` when the turn hit its budget, ``stop_sequence``
(with ``stop_sequence`` set) when it ended on one of the request's, else ``end_turn``.
``usage`` counts the turn's prompt and completion tokens. asyncrl's own facts (the session,
its segments) go under ``asyncrl``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from rollout_service.openai.turns import TurnOutcome


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(out: TurnOutcome) -> str:
    if out.tool_calls:
        return "tool_use"
    if out.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if out.stop_sequence is not None else "end_turn"


def content_blocks(out: TurnOutcome, fresh_ids: bool = False) -> list[dict[str, Any]]:
    """``fresh_ids``: each ``tool_use`` a new ``toolu_`` id (the stateless route, whose turns
    would otherwise number their calls from 0 each time: ids repeated across a conversation)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": out.content}] if out.content else []
    for call in out.tool_calls:
        fn = call["function"]
        args = fn["arguments"]
        blocks.append({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}" if fresh_ids else call["id"],
                       "name": fn["name"], "input": json.loads(args) if isinstance(args, str) else args})
    return blocks


def message_skeleton(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The ``message`` as ``message_start`` streams it: no content, no stop reason yet."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0,
                                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def message_object(message_id: str, model: str, out: TurnOutcome, extra: dict[str, Any] | None = None,
                   fresh_ids: bool = False) -> dict[str, Any]:
    body = message_skeleton(message_id, model, out.prompt_tokens)
    body.update({"content": content_blocks(out, fresh_ids), "stop_reason": stop_reason(out),
                 "stop_sequence": out.stop_sequence})
    body["usage"]["output_tokens"] = out.completion_tokens
    if extra:
        body["asyncrl"] = extra
    return body
