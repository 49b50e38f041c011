"""Issue 52: the Chat stream of a turn translated into the Responses API's events, on fixed
chat chunks: text deltas, then a tool call at the end, then the completed response; an engine
failure ends the stream with ``error`` and ``response.failed``; sequence numbers count up."""

from __future__ import annotations

import json

from rollout_service.openai.responses_stream import responses_events


def chat_sse(*objs) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


async def collect(pieces, final):
    async def stream():
        for p in pieces:
            yield p

    out = []
    async for raw in responses_events(stream(), {"id": "resp_1", "status": "in_progress", "output": []}, final):
        lines = raw.decode().split("\n")
        kind, body = lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))
        assert body["type"] == kind
        out.append(body)
    return out


def content(text):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


async def test_text_then_a_tool_call_then_completed():
    stored = {"id": "resp_1", "status": "completed", "output": [
        {"type": "message", "id": "msg_x", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me compute.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calculator", "arguments": '{"expression": "1+1"}',
         "status": "completed"}]}
    events = await collect(chat_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                                    content("Let me "), content("compute."),
                                    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1"}]}}]}), lambda: stored)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    msg_id = events[2]["item"]["id"]
    assert events[-1]["response"]["output"][0]["id"] == msg_id == stored["output"][0]["id"], "the stored object agrees"
    assert events[10]["delta"] == '{"expression": "1+1"}' and events[9]["output_index"] == 1


async def test_an_engine_failure_ends_with_error_and_failed():
    events = await collect(chat_sse(content("Hel"), {"error": {"message": "engine error: gone", "code": 502, "param": None}}),
                           lambda: None)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and "gone" in events[-2]["message"]


async def test_a_turn_that_hit_its_budget_ends_incomplete():
    stored = {"id": "resp_1", "status": "incomplete", "output": [
        {"type": "message", "id": "m", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "abc", "annotations": []}]}]}
    events = await collect(chat_sse(content("abc")), lambda: stored)
    assert events[-1]["type"] == "response.incomplete"


async def test_closing_either_stream_closes_the_chat_stream_at_once():
    """A session closes the Responses or Messages body, then releases its lock: the Chat stream
    (whose ``finally`` cancels the turn) must be closed by then, not later by the event loop's
    finaliser for abandoned generators."""
    import contextlib

    from rollout_service.openai.messages_stream import messages_events

    for events in (responses_events, messages_events):
        closed = []

        async def chat_stream(closed=closed):
            try:
                yield chat_sse(content("Hel"))[0]
                yield chat_sse(content("lo"))[0]
            finally:
                closed.append(True)

        async with contextlib.aclosing(events(chat_stream(), {"id": "x", "status": "in_progress", "output": [],
                                                              "content": []}, lambda: None)) as body:
            async for raw in body:
                if b"delta" in raw:
                    break  # the client goes away mid-turn
        assert closed == [True], f"{events.__name__} left the Chat stream open"
