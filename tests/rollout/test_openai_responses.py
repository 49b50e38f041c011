"""Issue 52: the Responses API on a session, driven by the official openai client
(``client.responses.create``): a function call, its output sent back through
``previous_response_id``, the final answer streamed (the Responses event sequence); ``GET`` of
a stored response; the published trajectory holds exactly the engine's token ids and
log-probs, the tool output masked — as a Chat session's does. What is not supported is a 400
naming it."""

from __future__ import annotations

import json

import httpx
import msgspec
import openai
import pytest
from openai import OpenAI

from asyncrl.chat import ChatTokenizer
from asyncrl.models import load_tokenizer
from tests.helpers.recording_proxy import RecordingProxy
from tests.rollout.conftest import running_service
from tests.rollout.test_openai_api import (
    CALC,
    QUESTION,
    _in_thread,
    check_trajectory,
    finish,
    idle_cfg,
    new_session,
)
from tests.rollout.test_service_episodes import fetch_all
from tools.calculator import evaluate_expression, format_number

TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
          "parameters": t["function"]["parameters"]} for t in CALC]


async def test_a_responses_tool_round_trip_is_recorded_token_for_token(tmp_path, nats_server, warm_engine, warm_model):
    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            sess = await new_session(url, data_source="external/arith", group_size=1)
            client = OpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120, max_retries=0)
            first = await _in_thread(lambda: client.responses.create(model="policy", input=QUESTION, tools=TOOLS,
                                                                     temperature=0, max_output_tokens=64))
            calls = [item for item in first.output if item.type == "function_call"]
            assert first.status == "completed" and calls and calls[0].name == "calculator", first.output
            assert first.usage.output_tokens > 0 and first.model_extra["asyncrl"]["session_id"] == sess["id"]
            expr = json.loads(calls[0].arguments)["expression"]
            events = await _in_thread(lambda: list(client.responses.create(
                model="policy", previous_response_id=first.id, tools=TOOLS, temperature=0, max_output_tokens=64, stream=True,
                input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                        "output": format_number(evaluate_expression(expr))}])))
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
            assert [e.sequence_number for e in events] == list(range(len(events)))
            second = events[-1].response
            streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
            assert second.previous_response_id == first.id and "boxed" in second.output_text
            assert streamed == second.output_text and "response.output_item.done" in kinds
            again = await _in_thread(lambda: client.responses.retrieve(second.id))
            assert again.id == second.id and again.output_text == second.output_text
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await _in_thread(lambda: client.responses.create(model="policy", previous_response_id="resp_unknown", input="x"))
            with pytest.raises(openai.BadRequestError, match="web_search"):
                await _in_thread(lambda: client.responses.create(model="policy", input="x", tools=[{"type": "web_search"}]))
            async with httpx.AsyncClient() as http:
                missing = await http.get(f"{sess['base_url']}/responses/resp_nope", headers={"Authorization": f"Bearer {sess['token']}"})
            assert missing.status_code == 404 and "resp_nope" in missing.json()["error"]["message"]
            state = await finish(url, sess, reward=1.0)
            assert state["turns"] == 2 and state["segments"] == 1, "the refused requests left the session as it was"
        trajs = await fetch_all(nats_server.url, "demo", 2)
    finally:
        await proxy.stop()
    traj = next(t for t in trajs if t.id == sess["id"])
    mine = [resp for req, resp in proxy.exchanges if f".{traj.id}." in req["rid"]]
    engine_lps = [[t[0] for t in resp["meta_info"]["output_token_logprobs"]] for resp in mine]
    chat = ChatTokenizer(load_tokenizer(str(warm_model)), CALC)
    check_trajectory(traj, proxy, engine_lps, chat, [{"role": "user", "content": QUESTION}])
    assert 0 in traj.loss_mask and traj.loss_mask[0] == 1, "the tool output is in the response, masked"


async def test_stateless_responses_answer_and_stream_but_store_nothing(tmp_path, nats_server, warm_engine):
    from tests.rollout.test_openai_api import API

    async with running_service(idle_cfg(tmp_path, nats_server.url, warm_engine)) as (svc, url):
        client = OpenAI(base_url=f"{url}/v1", api_key=API, timeout=120, max_retries=0)
        plain = await _in_thread(lambda: client.responses.create(model="policy", input="Say hi.", instructions="Be brief.",
                                                                 temperature=0, max_output_tokens=8))
        assert plain.status in ("completed", "incomplete") and plain.usage.output_tokens > 0
        events = await _in_thread(lambda: list(client.responses.create(model="policy", input="Say hi.", temperature=0,
                                                                       max_output_tokens=8, stream=True)))
        assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
        with pytest.raises(openai.BadRequestError, match="previous_response_id needs a session"):
            await _in_thread(lambda: client.responses.create(model="policy", input="x", previous_response_id=plain.id))
        assert svc.sessions.open_count == 0


async def test_a_response_with_store_false_is_recorded_but_not_kept(tmp_path, nats_server, warm_engine):
    async with running_service(idle_cfg(tmp_path, nats_server.url, warm_engine)) as (svc, url):
        sess = await new_session(url, group_size=1)
        client = OpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120, max_retries=0)
        unkept = await _in_thread(lambda: client.responses.create(model="policy", input="Say hi.", store=False, temperature=0,
                                                                  max_output_tokens=8))
        assert unkept.store is False and unkept.usage.output_tokens > 0
        with pytest.raises(openai.NotFoundError):
            await _in_thread(lambda: client.responses.retrieve(unkept.id))
        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await _in_thread(lambda: client.responses.create(model="policy", input="More.", previous_response_id=unkept.id))
        state = await finish(url, sess, reward=0.0)
        assert state["turns"] == 1, "the turn itself is recorded (training data), only the response object is not kept"


async def test_a_session_keeps_only_what_it_can_persist(tmp_path, nats_server, warm_engine):
    """Issue 67 M2: each stored response echoes its ``metadata``, ``instructions`` and ``tools``,
    so 12 turns with 3 MB of metadata took +98 MiB and the session silently stopped being
    persisted (lost at a restart). With the official client: ``metadata`` is bounded as OpenAI
    bounds it (16 pairs, 64-character keys, 512-character values: 400 naming the bound); a
    session stores at most ``api.max_session_responses`` responses (then 400 naming the
    setting; ``store=false`` goes on); a turn whose record would pass
    ``api.max_session_record_bytes`` is refused before it runs; every accepted turn is in the
    sessions bucket, and a refused one changed nothing there."""
    from rollout_service.openai.sessions import SessionRecord

    cfg = idle_cfg(tmp_path, nats_server.url, warm_engine, "api.max_session_responses=2", "api.max_session_record_bytes=65536")
    async with running_service(cfg) as (svc, url):
        sess = await new_session(url, data_source="external/arith", group_size=1)
        client = OpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120, max_retries=0)

        def ask(**kw):
            return _in_thread(lambda: client.responses.create(model="policy", input="1+1", temperature=0, max_output_tokens=4, **kw))

        for bad, needle in (({f"k{i}": "v" for i in range(17)}, "17 pairs (limit 16)"), ({"k" * 65: "v"}, "65 characters (limit 64)"),
                            ({"k": "v" * 513}, "513 characters (limit 512)")):
            with pytest.raises(openai.BadRequestError) as refused:
                await ask(metadata=bad)
            assert needle in str(refused.value), refused.value
        first = await ask(metadata={"k": "v" * 512})
        second = await ask(previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError, match="api.max_session_responses"):
            await ask(previous_response_id=second.id)
        await ask(previous_response_id=second.id, store=False)  # not stored: goes on
        saved = await svc.sessions.kv.get(sess["id"].replace(".", "_"))
        before = msgspec.msgpack.decode(saved.value, type=SessionRecord)
        assert sorted(before.responses) == sorted([first.id, second.id])
        with pytest.raises(openai.BadRequestError, match="api.max_session_record_bytes"):
            await _in_thread(lambda: client.responses.create(model="policy", input="1+1", instructions="x" * 70_000,
                                                             max_output_tokens=4, store=False))
        after = await svc.sessions.kv.get(sess["id"].replace(".", "_"))
        assert after.value == saved.value, "a refused turn changed the saved record"
