"""A streamed Responses API turn (issue 52): the Chat turn's stream
(:func:`~rollout_service.openai.streaming.stream_turn`, the one turn loop with its pause and
retry behaviour) translated event by event into the Responses API's server-sent events.

Sequence: ``response.created``, ``response.in_progress``; while text arrives, the message item
(``response.output_item.added``, ``response.content_part.added``, then one
``response.output_text.delta`` per Chat content delta); at the end ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` for the message, then per tool
call ``response.output_item.added``, ``response.function_call_arguments.delta`` (the whole
arguments: the Chat stream sends parsed calls at the end), ``response.function_call_arguments.done``
and ``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when
the token budget ran out) with the stored ``response`` object. An engine failure ends the
stream with ``error`` and ``response.failed``. Every event carries ``sequence_number``.

``final()`` gives the stored ``response`` object once the turn is over (the route's ``done``
stored it): the message item's id is set to the one streamed, so both agree.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from rollout_service.openai.streaming import ContentDeltas


class _Events:
    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()



async def responses_events(chat_stream: AsyncIterator[bytes], skeleton: dict[str, Any],
                           final: Callable[[], dict[str, Any] | None]) -> AsyncIterator[bytes]:
    """The Responses events for one streamed turn (module docstring); ``skeleton``: the
    ``response`` object as it starts (``status`` ``in_progress``, no output)."""
    ev = _Events()
    yield ev("response.created", response=skeleton)
    yield ev("response.in_progress", response=skeleton)
    msg_id, text, deltas = None, "", ContentDeltas(chat_stream)
    async with contextlib.aclosing(aiter(deltas)) as each:  # closed with this stream: the turn too
        async for delta in each:
            if msg_id is None:
                msg_id = f"msg_{uuid.uuid4().hex[:24]}"
                yield ev("response.output_item.added", output_index=0,
                         item={"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []})
                yield ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                         part={"type": "output_text", "text": "", "annotations": []})
            text += delta
            yield ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0, delta=delta)
    if (failed := deltas.error) is not None:
        yield ev("error", code=str(failed.get("code")), message=failed.get("message"), param=failed.get("param"))
        yield ev("response.failed", response={**skeleton, "status": "failed",
                                              "error": {"code": "server_error", "message": failed.get("message")}})
        return
    response = final()
    if response is None:  # the turn did not complete (the stream was closed)
        return
    items = response["output"]
    if msg_id is not None:
        message = next((i for i in items if i["type"] == "message"), None)
        if message is None:  # text was streamed that the parsed turn holds none of (blank before a tool call)
            message = {"type": "message", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]}
            items.insert(0, message)
        message["id"] = msg_id
        part = message["content"][0]
        yield ev("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=part["text"])
        yield ev("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=0, item=message)
    for index, item in enumerate(items):
        if item["type"] != "function_call":
            continue
        yield ev("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"])
        yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"])
        yield ev("response.output_item.done", output_index=index, item=item)
    yield ev("response.incomplete" if response["status"] == "incomplete" else "response.completed", response=response)
