"""A streamed Anthropic Messages turn (issue 52): the Chat turn's stream
(:func:`~rollout_service.openai.streaming.stream_turn`, the one turn loop with its pause and
retry behaviour) translated into Anthropic's server-sent events.

Sequence: ``message_start`` (the message without content), ``ping``; while text arrives a
``text`` block (``content_block_start`` at index 0, one ``content_block_delta`` with a
``text_delta`` per Chat content delta, ``content_block_stop``); then per tool call a
``tool_use`` block (``content_block_start`` with an empty ``input``, one ``input_json_delta``
holding the whole arguments — the Chat stream sends parsed calls at the end —,
``content_block_stop``); last ``message_delta`` (``stop_reason``, ``stop_sequence``, ``usage``)
and ``message_stop``. An engine failure ends the stream with an ``error`` event in Anthropic's
error shape. ``final()`` gives the ``message`` object once the turn is over (None when it did
not complete).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout_service.openai.streaming import ContentDeltas


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()



async def messages_events(chat_stream: AsyncIterator[bytes], skeleton: dict[str, Any],
                          final: Callable[[], dict[str, Any] | None]) -> AsyncIterator[bytes]:
    """Anthropic's events for one streamed turn (module docstring)."""
    yield _event("message_start", message=skeleton)
    yield _event("ping")
    text_open, deltas = False, ContentDeltas(chat_stream)
    async with contextlib.aclosing(aiter(deltas)) as each:  # closed with this stream: the turn too
        async for delta in each:
            if not text_open:
                text_open = True
                yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta})
    if (failed := deltas.error) is not None:
        kind = failed.get("type")  # OpenAI's error types below 500 are Anthropic's names too
        yield _event("error", error={"type": "api_error" if kind in (None, "server_error") else kind, "message": failed.get("message")})
        return
    message = final()
    if message is None:  # the turn did not complete (the stream was closed)
        return
    index = 0
    if text_open:
        yield _event("content_block_stop", index=0)
        index = 1
    for block in message["content"]:
        if block["type"] != "tool_use":
            continue
        yield _event("content_block_start", index=index, content_block={**block, "input": {}})
        yield _event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        yield _event("content_block_stop", index=index)
        index += 1
    yield _event("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                 usage={"output_tokens": message["usage"]["output_tokens"]})
    yield _event("message_stop")
