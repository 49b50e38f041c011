"""A session's Responses API history (rollout_service/openai/responses_history.py): each message
stored once, conversations rebuilt through ``previous_response_id`` chains."""

from __future__ import annotations

import msgspec

from rollout_service.openai.responses_history import StoredResponse, conversation, remember
from rollout_service.openai.responses_request import ResponsesRequest, lower


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def turn(responses: dict, rid: str, req: ResponsesRequest, answer: str) -> list[dict]:
    """What the session route does: lower with the parent's conversation, keep the new part."""
    previous = conversation(responses, req.previous_response_id) if req.previous_response_id else None
    messages = [m.to_template() for m in lower(req, previous).messages]
    remember(responses, rid, req.previous_response_id, messages[(1 if req.instructions else 0) + len(previous or []):],
             said(answer), {"id": rid})
    return messages


def test_a_chain_stores_each_message_once_and_rebuilds_every_conversation():
    responses: dict[str, StoredResponse] = {}
    turn(responses, "r1", ResponsesRequest(input="one", instructions="Be brief."), "a1")
    sent = turn(responses, "r2", ResponsesRequest(input="two", previous_response_id="r1", instructions="Be terse."), "a2")
    assert sent == [{"role": "system", "content": "Be terse."}, user("one"), said("a1"), user("two")], \
        "the new instructions lead; the earlier ones do not carry over"
    for i in range(3, 40):
        turn(responses, f"r{i}", ResponsesRequest(input=f"q{i}", previous_response_id=f"r{i - 1}"), f"a{i}")
    assert conversation(responses, "r39")[-2:] == [user("q39"), said("a39")]
    assert len(conversation(responses, "r39")) == 2 * 39
    assert sum(len(s.added) for s in responses.values()) == 2 * 39, "every message is stored once: linear, not quadratic"
    assert conversation(responses, "r2") == [user("one"), said("a1"), user("two"), said("a2")]


def test_a_developer_message_in_the_input_carries_over_and_branches_keep_their_own_history():
    responses: dict[str, StoredResponse] = {}
    turn(responses, "r1", ResponsesRequest(input=[{"role": "developer", "content": "Use tools."}, user("one")]), "a1")
    turn(responses, "left", ResponsesRequest(input="left?", previous_response_id="r1"), "L")
    turn(responses, "right", ResponsesRequest(input="right?", previous_response_id="r1"), "R")
    base = [{"role": "system", "content": "Use tools."}, user("one"), said("a1")]
    assert conversation(responses, "left") == [*base, user("left?"), said("L")]
    assert conversation(responses, "right") == [*base, user("right?"), said("R")]
    assert conversation(responses, "nope") is None


def test_the_stored_history_survives_the_session_records_encoding():
    responses = {"r1": StoredResponse(parent=None, added=[user("one"), said("a1")], object={"id": "r1"}),
                 "r2": StoredResponse(parent="r1", added=[user("two"), said("a2")], object={"id": "r2"})}
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(responses), type=dict[str, StoredResponse])
    assert conversation(back, "r2") == [user("one"), said("a1"), user("two"), said("a2")]
