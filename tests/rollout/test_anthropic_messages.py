"""Issue 52: Anthropic's Messages API on a session, driven by the official ``anthropic`` client
(``messages.create``, ``messages.stream``): a ``tool_use`` answered with a ``tool_result``, the
final answer streamed (Anthropic's event sequence, accumulated by the client's own stream
helper); the published trajectory holds exactly the engine's token ids and log-probs, the tool
output masked — as a Chat session's does. Bad input is a 4xx in Anthropic's error shape that
leaves the session as it was; ``x-api-key`` is the session token."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from anthropic import Anthropic

from asyncrl.chat import ChatTokenizer
from asyncrl.models import load_tokenizer
from tests.helpers.recording_proxy import RecordingProxy
from tests.rollout.conftest import running_service
from tests.rollout.test_openai_api import (
    API,
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

TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
          "input_schema": t["function"]["parameters"]} for t in CALC]


async def test_an_anthropic_tool_round_trip_is_recorded_token_for_token(tmp_path, nats_server, warm_engine, warm_model):
    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            sess = await new_session(url, data_source="external/arith", group_size=1)
            client = Anthropic(base_url=sess["anthropic_base_url"], api_key=sess["token"], timeout=120, max_retries=0)
            question = [{"role": "user", "content": QUESTION}]
            first = await _in_thread(lambda: client.messages.create(model="policy", max_tokens=64, extra_body={"temperature": 0},
                                                                    messages=question, tools=TOOLS))
            uses = [b for b in first.content if b.type == "tool_use"]
            assert first.stop_reason == "tool_use" and uses and uses[0].name == "calculator", first.content
            assert first.usage.output_tokens > 0 and first.model_extra["asyncrl"]["session_id"] == sess["id"]
            history = [*question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}]
            answer = format_number(evaluate_expression(uses[0].input["expression"]))
            with pytest.raises(anthropic.BadRequestError) as bad:
                await _in_thread(lambda: client.messages.create(model="policy", max_tokens=64, tools=TOOLS, messages=[
                    *history, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_other", "content": answer}]}]))
            assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
            assert "toolu_other" in bad.value.body["error"]["message"]
            with pytest.raises(anthropic.BadRequestError, match="image"):
                await _in_thread(lambda: client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]))
            with pytest.raises(anthropic.BadRequestError, match="web_search"):
                await _in_thread(lambda: client.messages.create(model="policy", max_tokens=8, messages=question,
                                                                tools=[{"type": "web_search_20250305", "name": "web_search"}]))

            def streamed():
                with client.messages.stream(model="policy", max_tokens=64, extra_body={"temperature": 0}, tools=TOOLS, messages=[
                        *history, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": answer}]}]) as s:
                    return [e.type for e in s], s.get_final_message()

            kinds, second = await _in_thread(streamed)
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds, kinds
            text = "".join(b.text for b in second.content if b.type == "text")
            assert second.stop_reason == "end_turn" and "boxed" in text and second.usage.output_tokens > 0
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


async def test_stateless_messages_take_x_api_key_and_answer_errors_in_anthropics_shape(tmp_path, nats_server, warm_engine):
    async with running_service(idle_cfg(tmp_path, nats_server.url, warm_engine)) as (svc, url):
        client = Anthropic(base_url=url, api_key=API, timeout=120, max_retries=0)
        plain = await _in_thread(lambda: client.messages.create(model="policy", max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
                                                                messages=[{"role": "user", "content": "Say hi."}]))
        assert plain.stop_reason in ("end_turn", "max_tokens") and plain.usage.output_tokens > 0 and plain.id.startswith("msg_")
        with pytest.raises(anthropic.PermissionDeniedError) as denied:  # a wrong token is a 403 on every route
            await _in_thread(lambda: Anthropic(base_url=url, api_key="wrong-token-000000", max_retries=0).messages.create(
                model="policy", max_tokens=8, messages=[{"role": "user", "content": "x"}]))
        assert denied.value.body == {"type": "error", "error": {"type": "permission_error", "message": "invalid API token"}}
        async with httpx.AsyncClient() as http:
            auth = {"x-api-key": API, "anthropic-version": "2023-06-01"}
            anonymous = await http.post(f"{url}/v1/messages", headers={"anthropic-version": "2023-06-01"},
                                        json={"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
            assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"
            assert "x-api-key" in anonymous.json()["error"]["message"]
            missing = await http.post(f"{url}/v1/messages", headers=auth, json={"model": "policy", "messages": [{"role": "user", "content": "x"}]})
            assert missing.status_code == 400 and missing.json()["type"] == "error", missing.text
            assert missing.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in missing.json()["error"]["message"]
            thinking = await http.post(f"{url}/v1/messages", headers=auth, json={
                "model": "policy", "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "x"}]})
            assert thinking.status_code == 400 and "thinking" in thinking.json()["error"]["message"]
            chat = await http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {API}"}, json={"messages": []})
            assert "error" in chat.json() and "type" not in chat.json(), "other routes keep OpenAI's envelope"
        assert svc.sessions.open_count == 0
