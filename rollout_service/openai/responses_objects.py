"""The Responses API's ``response`` object for one turn (issue 52), built from the turn's
:class:`~rollout_service.openai.turns.TurnOutcome` — what ``POST .../v1/responses`` answers and
``GET .../v1/responses/{id}`` returns again.

``output``: a ``message`` item with the turn's text (``output_text``) when it has any, then one
``function_call`` item per tool call (``call_id`` = the Chat tool call's id, which the client
sends back in its ``function_call_output``). ``status`` is ``completed``, or ``incomplete``
with ``incomplete_details.reason = "max_output_tokens"`` when the turn hit its token budget.
``usage`` counts the turn's prompt and completion tokens. The request's settings are echoed as
the Responses API does (``instructions``, ``tools``, ``tool_choice``, ``temperature``, ...).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from rollout_service.openai.responses_request import ResponsesRequest
from rollout_service.openai.turns import TurnOutcome


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def output_items(out: TurnOutcome) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if out.content:
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": out.content, "annotations": []}]})
    for call in out.tool_calls:
        fn = call["function"]
        arguments = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": call["id"],
                      "name": fn["name"], "arguments": arguments, "status": "completed"})
    return items


def response_skeleton(response_id: str, model: str, req: ResponsesRequest) -> dict[str, Any]:
    """The ``response`` object before its turn: ``in_progress``, no output, the request echoed."""
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model, "status": "in_progress",
        "error": None, "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature, "top_p": req.top_p or 1.0,
        "text": {"format": {"type": "text"}}, "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": list(req.tools or []), "truncation": "disabled", "usage": None, "metadata": dict(req.metadata or {}),
    }


def response_object(response_id: str, model: str, req: ResponsesRequest, out: TurnOutcome,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object (module docstring); ``extra``: asyncrl's own facts (the session,
    its segments) under ``asyncrl`` and, as strings, in ``metadata``."""
    incomplete = out.finish_reason == "length"
    body = response_skeleton(response_id, model, req)
    body.update({
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output_items(out),
        "usage": {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": out.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": out.prompt_tokens + out.completion_tokens},
    })
    if extra:
        body["asyncrl"] = extra
        body["metadata"] = {**{k: str(v) for k, v in extra.items()}, **body["metadata"]}
    return body
