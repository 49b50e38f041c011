"""Small units of the agent loop: appending engine answers, parsing tool calls."""

from __future__ import annotations

import types

import pytest

from asyncrl.engine_client.errors import EngineError
from asyncrl.engine_client.types import GenerateResult
from rollout_service.agent.state import AgentState
from rollout_service.agent.tool_parser import parse_hermes
from rollout_service.agent.turn import append_model_tokens


def _deps():
    seen = []
    return types.SimpleNamespace(on_tokens=lambda d, k: seen.append((d, k))), seen


def _state():
    return AgentState(id="t", run_id="r", group_id="g", group_size=1, group_index=0, prompt_id="p", data_source="d",
                      token_ids=[1, 2], prompt_length=2)


def test_an_abort_in_the_waiting_queue_adds_nothing():
    # SGLang's shape for a request aborted before it ran: no output_token_logprobs at all
    res = GenerateResult.parse({"text": "", "output_ids": [], "meta_info": {
        "id": "x", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"}, "weight_version": "3",
        "completion_tokens": 0}})
    deps, seen = _deps()
    state = _state()
    append_model_tokens(state, res, deps)
    assert state.token_ids == [1, 2] and state.loss_mask == [] and seen == [(0, 0)]


def test_tokens_with_versions_spans_and_mismatched_logprobs():
    res = GenerateResult.parse({"text": "ab", "output_ids": [7, 8], "meta_info": {
        "id": "x", "finish_reason": {"type": "stop", "matched": 8}, "weight_version": "4", "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
        "weight_versions": [{"version": "3", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 2}]}})
    deps, _ = _deps()
    state = _state()
    append_model_tokens(state, res, deps)
    assert (state.token_ids, state.loss_mask, state.logprobs, state.versions) == ([1, 2, 7, 8], [1, 1], [-0.5, -0.25], [3, 4])
    assert (state.version_start, state.version_end) == (3, 4)
    broken = GenerateResult.parse({"text": "a", "output_ids": [7], "meta_info": {"id": "x", "finish_reason": {"type": "stop"}}})
    with pytest.raises(EngineError, match="without matching logprobs"):
        append_model_tokens(_state(), broken, deps)


@pytest.mark.parametrize("text,names,errors,content", [
    ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>', ["calculator"], [None], ""),
    ('Let me see. <tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>', ["a"], [None], "Let me see."),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>', ["a", "b"], [None, None], ""),
    ("<tool_call>{not json}</tool_call>", [""], ["not valid JSON"], ""),
    ('<tool_call>{"arguments": {}}</tool_call>', [""], ["no \"name\""], ""),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', ["a"], ["must be a JSON object"], ""),
    ('answer <tool_call>{"name": "a"', [""], ["unterminated"], "answer"),
    ("plain answer \\boxed{3}", [], [], "plain answer \\boxed{3}"),
])
def test_hermes_parser(text, names, errors, content):
    parsed = parse_hermes(text, turn=2)
    assert [c.name for c in parsed.calls] == names
    for call, err in zip(parsed.calls, errors):
        assert (call.error is None) if err is None else (err in call.error)
    assert [c.id for c in parsed.calls] == [f"call_2_{i}" for i in range(len(names))]
    assert parsed.content == content
