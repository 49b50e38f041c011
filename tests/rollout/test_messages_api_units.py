"""Issue 52, Anthropic Messages without a service: the request lowered onto Chat (blocks,
tool_use / tool_result pairing, tool_choice, refusals naming what is unsupported), the stream
translated into Anthropic's events on fixed chat chunks, the error rewrite on the Messages paths
only (413 of the size limit included) and the OpenAPI document's error shape there."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError

from asyncrl.http.errors import ApiError, BodySizeLimit, install_error_handlers
from asyncrl.http.openapi import document_errors, errors
from rollout_service.openai.messages_errors import AnthropicErrors, envelope_for
from rollout_service.openai.messages_objects import message_object
from rollout_service.openai.messages_request import MessagesRequest, lower_messages
from rollout_service.openai.messages_stream import messages_events
from rollout_service.openai.turns import TurnOutcome

TOOL = {"name": "calculator", "description": "math", "input_schema": {"type": "object", "properties": {"e": {"type": "string"}}}}


def req(**body) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 16, **body})


def test_blocks_lower_onto_chat_messages_with_tool_calls_and_tool_results():
    chat = lower_messages(req(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}], tools=[TOOL],
                              tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"], messages=[
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Computing."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"e": "2+2"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "4"}]},
                                     {"type": "text", "text": "Now answer."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "calculator", "input": {"e": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "bad", "is_error": True}]}]))
    got = [m.to_template() for m in chat.messages]
    assert got[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}, "text blocks joined by a blank line"
    assert got[2]["content"] == "Computing." and got[2]["tool_calls"][0]["id"] == "toolu_1"
    assert json.loads(got[2]["tool_calls"][0]["function"]["arguments"]) == {"e": "2+2"}
    assert got[3]["role"] == "tool" and got[3]["tool_call_id"] == "toolu_1" and got[3]["content"] == "4"
    assert got[4] == {"role": "user", "content": "Now answer."}, "a user turn's text comes after its tool results"
    assert got[-1]["content"] == "Error: bad", "an error result says so"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and chat.stop == ["END"]
    assert chat.tools[0].function.parameters == TOOL["input_schema"] and chat.max_tokens == 16
    assert lower_messages(req(tools=[TOOL], tool_choice={"type": "tool", "name": "calculator"},
                              messages=[{"role": "user", "content": "x"}])).tool_choice.function == {"name": "calculator"}


def test_what_agent_harnesses_send_is_taken():
    """A tool's image in its result (a placeholder: the policy reads text), a system turn inside
    ``messages``, a client tool's ``strict``, adaptive thinking, a ``max_tokens`` above the
    service's limit (lowered to it: a cap)."""
    chat = lower_messages(req(max_tokens=64000, thinking={"type": "adaptive"}, tools=[{**TOOL, "strict": True}], messages=[
        {"role": "user", "content": "Look."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "shot:"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]},
        {"role": "system", "content": "Be brief."}]), max_tokens_cap=8192)
    got = [m.to_template() for m in chat.messages]
    assert got[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "shot:\n\n[image]"}
    assert got[3] == {"role": "system", "content": "Be brief."} and chat.max_tokens == 8192


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "4"}]}]}, "toolu_9"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]}]}, "'thinking'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "c", "input": "2+2"}]}]}, "object input"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
])
def test_malformed_or_unsupported_blocks_are_a_400_naming_them(body, named):
    with pytest.raises(ApiError) as err:
        lower_messages(req(**body))
    assert err.value.status == 400 and named in err.value.message


@pytest.mark.parametrize(("body", "named"), [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    ({"top_k": 5}, "top_k"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config"),
    ({"temperature": 1.5}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_unsupported_parameters_are_refused_by_name(body, named):
    with pytest.raises(ValidationError, match=named):
        req(messages=[{"role": "user", "content": "x"}], **body)
    with pytest.raises(ValidationError, match="max_tokens"):
        MessagesRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert req(messages=[{"role": "user", "content": "x"}], cache_control={"type": "ephemeral"}, speed="fast",
               thinking={"type": "disabled"}).max_tokens == 16, "hints without effect on the tokens are accepted"


def outcome(**kw) -> TurnOutcome:
    base = dict(text="", content=None, tool_calls=[], finish_reason="stop", model_ids=[], model_logprobs=[], top_logprobs=None,
                weight_version=3, ended_by_eos=True, prompt_tokens=20, completion_tokens=7)
    return TurnOutcome(**{**base, **kw})


def test_the_message_object_says_why_the_turn_stopped():
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": "1+1"}'}}
    tool = message_object("msg_1", "policy", outcome(content="Let me.", tool_calls=[call], finish_reason="tool_calls"))
    assert tool["stop_reason"] == "tool_use" and tool["content"][1] == {"type": "tool_use", "id": "call_1", "name": "calculator",
                                                                       "input": {"e": "1+1"}}
    assert tool["usage"]["input_tokens"] == 20 and tool["usage"]["output_tokens"] == 7
    assert message_object("m", "p", outcome(content="x", finish_reason="length"))["stop_reason"] == "max_tokens"
    fresh = [message_object("m", "p", outcome(tool_calls=[call], finish_reason="tool_calls"), fresh_ids=True)["content"][0]["id"]
             for _ in range(2)]
    assert fresh[0] != fresh[1] and fresh[0].startswith("toolu_"), "the stateless route never repeats an id"
    stop = message_object("m", "p", outcome(content="x", stop_sequence="END", ended_by_eos=False))
    assert stop["stop_reason"] == "stop_sequence" and stop["stop_sequence"] == "END"
    assert message_object("m", "p", outcome(content="x"))["stop_reason"] == "end_turn"


def chat_sse(*objs) -> list[bytes]:
    return [f"data: {json.dumps(o)}\n\n".encode() for o in objs] + [b"data: [DONE]\n\n"]


def content(text):
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


async def collect(pieces, final):
    async def stream():
        for p in pieces:
            yield p

    out = []
    async for raw in messages_events(stream(), {"id": "msg_1", "type": "message", "content": []}, final):
        lines = raw.decode().split("\n")
        kind, body = lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: "))
        assert body["type"] == kind
        out.append(body)
    return out


async def test_the_stream_is_anthropics_event_sequence():
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": "1+1"}'}}
    final = message_object("msg_1", "p", outcome(content="Let me.", tool_calls=[call], finish_reason="tool_calls"))
    events = await collect(chat_sse(content("Let "), content("me.")), lambda: final)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "content_block_start",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[3]["delta"] == {"type": "text_delta", "text": "Let "} and events[6]["index"] == 1
    assert events[6]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {}}
    assert json.loads(events[7]["delta"]["partial_json"]) == {"e": "1+1"} and events[7]["delta"]["type"] == "input_json_delta"
    assert events[9]["delta"]["stop_reason"] == "tool_use" and events[9]["usage"] == {"output_tokens": 7}
    failed = await collect(chat_sse(content("Hel"), {"error": {"message": "engine error: gone", "type": "server_error",
                                                               "code": 502}}), lambda: None)
    assert failed[-1] == {"type": "error", "error": {"type": "api_error", "message": "engine error: gone"}}
    unmet = await collect(chat_sse({"error": {"message": "tool_choice ...", "type": "invalid_request_error",
                                              "code": "tool_choice_not_satisfied"}}), lambda: None)
    assert unmet[-1]["error"]["type"] == "invalid_request_error"


def test_errors_on_the_messages_paths_only_are_in_anthropics_shape():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/messages", responses=errors(404))
    async def messages(body: dict | None = None):
        raise ApiError(404, "no such thing", param="x")

    @app.post("/v1/chat/completions", responses=errors(404))
    async def chat(request: Request):
        raise ApiError(404, "no such thing", param="x")

    app.add_middleware(BodySizeLimit, max_bytes=100)
    app.add_middleware(AnthropicErrors)
    document_errors(app, authenticated=lambda path: True, envelope_for=envelope_for)
    http = TestClient(app)
    assert http.post("/v1/messages", json={}).json() == {"type": "error", "error": {"type": "not_found_error", "message": "no such thing"}}
    assert http.post("/v1/chat/completions").json()["error"]["param"] == "x", "OpenAI's envelope elsewhere"
    big = http.post("/v1/messages", content=b"x" * 200)
    assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
    assert int(big.headers["content-length"]) == len(big.content)
    doc = app.openapi()
    assert "AnthropicErrorEnvelope" in str(doc["paths"]["/v1/messages"]["post"]["responses"]["404"])
    assert "AnthropicErrorEnvelope" in str(doc["paths"]["/v1/messages"]["post"]["responses"]["413"])
    assert "AnthropicErrorEnvelope" not in str(doc["paths"]["/v1/chat/completions"]["post"]["responses"])
