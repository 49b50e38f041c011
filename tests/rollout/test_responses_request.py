"""Issue 52 (first part): a Responses API request lowered onto the Chat Completions request the
one turn loop serves — strings and items, tool calls and their outputs, chaining through a
previous response's messages, tools and tool_choice — and what is not supported refused with a
400 naming it. On fixed inputs; the routes come with the rest of the issue."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.http.errors import ApiError
from rollout_service.openai.responses_request import ResponsesRequest, lower

WEATHER = {"type": "function", "name": "weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_string_input_with_instructions_becomes_system_and_user():
    chat = lower(ResponsesRequest(input="What is 6*7?", instructions="Answer briefly.", max_output_tokens=32, temperature=0.5))
    assert [m.to_template() for m in chat.messages] == [{"role": "system", "content": "Answer briefly."},
                                                       {"role": "user", "content": "What is 6*7?"}]
    assert (chat.max_tokens, chat.temperature, chat.tools) == (32, 0.5, None)


def test_items_with_a_function_call_and_its_output_lower_to_tool_messages():
    req = ResponsesRequest(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
    ], tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False)
    chat = lower(req)
    msgs = [m.to_template() for m in chat.messages]
    assert msgs[0] == {"role": "user", "content": "Weather in Paris?"}
    assert msgs[1]["role"] == "assistant" and [c["id"] for c in msgs[1]["tool_calls"]] == ["call_1", "call_2"], "one turn's calls"
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"} and msgs[3]["content"] == "rain"
    assert chat.tools[0].function.name == "weather" and chat.tool_choice.function == {"name": "weather"}
    assert chat.parallel_tool_calls is False


def test_chaining_puts_the_new_instructions_then_the_previous_conversation_first():
    # the previous conversation comes without its instructions (responses_history keeps none)
    previous = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_9", "type": "function",
                                                                     "function": {"name": "weather", "arguments": "{}"}}]}]
    chat = lower(ResponsesRequest(input=[{"type": "function_call_output", "call_id": "call_9", "output": "sunny"}],
                                  instructions="new instructions", previous_response_id="resp_1"), previous)
    roles = [(m.role, m.content) for m in chat.messages]
    assert roles[0] == ("system", "new instructions") and roles[1] == ("user", "Weather in Paris?")
    assert roles[-1] == ("tool", "sunny") and chat.messages[-1].tool_call_id == "call_9"


@pytest.mark.parametrize(("body", "named"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}}}}, "text"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": []}, "input"),
    ({"input": ["just a string"]}, "input"),
])
def test_what_is_not_supported_is_refused_naming_it(body, named):
    with pytest.raises(ValidationError, match=named):
        ResponsesRequest.model_validate(body)


@pytest.mark.parametrize(("items", "named"), [
    ([{"type": "reasoning", "summary": []}], "'reasoning'"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "nope"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], "input_image"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}], "function_call needs"),
])
def test_bad_items_are_a_400_naming_the_item(items, named):
    with pytest.raises(ApiError) as err:
        lower(ResponsesRequest(input=items))
    assert err.value.status == 400 and named in err.value.message and err.value.param.startswith("input[0]")
