"""The OpenAI-compatible API driven by the official openai client (sync and async,
streaming and not, a tool-call round trip): the published trajectory holds exactly the
token ids and logprobs the engine produced."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from asyncrl.chat import ChatTokenizer
from asyncrl.models import load_tokenizer
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.scripted_engine import generate_answer
from tests.rollout.conftest import running_service, service_config
from tests.rollout.test_service_episodes import fetch_all, model_segments
from tools.calculator import evaluate_expression, format_number
from tools.registry import ToolRegistry

API = "data-plane-token-0123456789"
CALC = ToolRegistry.from_names(["calculator"]).schemas()
# in the demo task's distribution, which the warm test model was fine-tuned on
QUESTION = "What is 778 + 913 - 432? Use the calculator tool, then answer with \\boxed{N}."


def idle_cfg(tmp_path, nats_url, engine_url, *extra):
    """A service that runs no internal agents of its own (one sample, then the quota is free)."""
    return service_config(tmp_path, nats_url, [engine_url], "rollout.total_rollout_steps=1", "rollout.n=1",
                          "async_training.staleness_threshold=50", f"security.api_token={API}", "api.model_name=policy",
                          'api.model_aliases=["p"]', *extra)


async def new_session(url: str, **body) -> dict:
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{url}/v1/sessions", json=body, headers={"Authorization": f"Bearer {API}"})
        assert r.status_code == 201, r.text
        return r.json()


async def finish(url: str, sess: dict, reward: float) -> dict:
    async with httpx.AsyncClient() as http:
        auth = {"Authorization": f"Bearer {sess['token']}"}
        assert (await http.post(f"{url}/v1/sessions/{sess['id']}/reward", json={"reward": reward}, headers=auth)).status_code == 200
        r = await http.post(f"{url}/v1/sessions/{sess['id']}/finish", headers=auth)
        assert r.status_code == 200, r.text
        again = await http.post(f"{url}/v1/sessions/{sess['id']}/finish", headers=auth)  # idempotent
        assert again.status_code == 200 and again.json()["status"] == "finished"
        return r.json()


def check_trajectory(traj, proxy: RecordingProxy, api_logprobs: list[list[float]], chat: ChatTokenizer, first_messages):
    """Token ids = prompt rendering + exactly the engine's answers + tool segments; logprobs as returned."""
    assert chat.decode(traj.token_ids[: traj.prompt_length]) == chat.decode(chat.prompt_ids(first_messages))
    mine = [(req, resp) for req, resp in proxy.exchanges if f".{traj.id}." in req["rid"]]
    segs = model_segments(traj)
    assert len(mine) == len(segs) == len(api_logprobs)
    for (start, end), (req, resp), lps in zip(segs, mine, api_logprobs):
        triples = resp["meta_info"]["output_token_logprobs"]
        assert traj.response_ids[start:end] == [t[1] for t in triples]
        assert traj.rollout_logprobs[start:end] == [t[0] for t in triples] == lps
        assert req["input_ids"] == traj.token_ids[: traj.prompt_length + start], "next turn extends the recorded tokens"


async def test_sync_client_tool_round_trip_and_streamed_final_turn(tmp_path, nats_server, warm_engine, warm_model):
    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            sess = await new_session(url, data_source="external/arith", group_size=1)
            assert sess["base_url"].endswith(f"/v1/sessions/{sess['id']}/v1")
            client = OpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120)
            assert [m.id for m in (await _in_thread(client.models.list)).data] == [svc.model_name, "p"]  # name and alias
            messages = [{"role": "user", "content": QUESTION}]
            first = await _in_thread(lambda: client.chat.completions.create(
                model="policy", messages=messages, tools=CALC, temperature=0, max_tokens=64, logprobs=True))
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
            first.model_dump(warnings="error")  # asyncrl's extras fit the official client's types
            assert all(isinstance(v, str) for v in first.metadata.values()) and first.metadata["session_id"] == sess["id"]
            assert first.model_extra["asyncrl"]["session_id"] == sess["id"] and isinstance(first.model_extra["asyncrl"]["segments"], int)
            call = choice.message.tool_calls[0]
            assert call.function.name == "calculator" and first.usage.completion_tokens > 0
            lp1 = [c.logprob for c in choice.logprobs.content]
            messages.append(choice.message.model_dump(exclude_none=True))
            expr = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": format_number(evaluate_expression(expr))})
            stream = await _in_thread(lambda: list(client.chat.completions.create(
                model="policy", messages=messages, tools=CALC, temperature=0, max_tokens=64, stream=True, logprobs=True,
                stream_options={"include_usage": True})))
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            lp2 = [e.logprob for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            finish_reasons = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
            assert finish_reasons == ["stop"] and "boxed" in text
            assert stream[-1].usage is not None and stream[-1].usage.completion_tokens == len(lp2)
            state = await finish(url, sess, reward=1.0)
            assert state["segments"] == 1 and state["turns"] == 2 and state["reward"] == 1.0
        trajs = await fetch_all(nats_server.url, "demo", 2)  # the service's one internal trajectory + the session
    finally:
        await proxy.stop()
    traj = next(t for t in trajs if t.id == sess["id"])
    assert traj.reward == 1.0 and traj.data_source == "external/arith" and traj.metadata["session"]
    chat = ChatTokenizer(load_tokenizer(str(warm_model)), CALC)
    check_trajectory(traj, proxy, [lp1, lp2], chat, messages[:1])


async def test_each_turns_sampling_parameters_reach_the_trajectory(tmp_path, nats_server, warm_engine):
    """Turns at different temperatures / top_p: the trajectory records, per span of model
    tokens, the parameters the engine sampled (and reported logprobs) with, so the trainer
    scales each token's logits by its own temperature. The text generated is irrelevant."""
    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            sess = await new_session(url, data_source="external/sampling", group_size=1)
            client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120)
            messages = [{"role": "user", "content": "Say something."}]
            first = await client.chat.completions.create(model="policy", messages=messages, temperature=0.7, top_p=0.9, max_tokens=8)
            messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                         {"role": "user", "content": "And again."}]
            await client.chat.completions.create(model="policy", messages=messages, temperature=1.3, max_tokens=8)
            await finish(url, sess, reward=0.5)
        trajs = await fetch_all(nats_server.url, "demo", 2)
    finally:
        await proxy.stop()
    traj = next(t for t in trajs if t.id == sess["id"])
    sent = [req["sampling_params"] for req, _ in proxy.exchanges if f".{traj.id}." in req["rid"]]
    assert [(p["temperature"], p["top_p"]) for p in sent] == [(0.7, 0.9), (1.3, 1.0)]
    second_turn = model_segments(traj)[1][0]
    assert [(s.start, s.temperature, s.top_p) for s in traj.sampling] == [(0, 0.7, 0.9), (second_turn, 1.3, 1.0)]
    assert traj.temperature == 0.7 and traj.sampling_truncated and traj.failure == ""
    temps = traj.token_temperatures()
    assert set(temps[:second_turn]) == {0.7} and set(temps[second_turn:]) == {1.3}


async def test_a_session_text_completion_streams_and_records_its_tokens(tmp_path, nats_server, warm_engine, warm_model):
    prompt = [5, 6, 7, 8, 9]
    async with running_service(idle_cfg(tmp_path, nats_server.url, warm_engine)) as (svc, url):
        sess = await new_session(url, data_source="external/text", group_size=1)
        client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120)
        chunks = [c async for c in await client.completions.create(model="policy", prompt=prompt, max_tokens=6, temperature=0,
                                                                  stream=True, stream_options={"include_usage": True})]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finishes) == 1 and finishes[0] in ("stop", "length") and chunks[-1].usage.completion_tokens >= 1
        await finish(url, sess, reward=0.0)
        trajs = await fetch_all(nats_server.url, "demo", 2)
    traj = next(t for t in trajs if t.id == sess["id"])
    chat = ChatTokenizer(load_tokenizer(str(warm_model)))
    assert traj.token_ids[: traj.prompt_length] == prompt and traj.loss_mask == [1] * traj.response_length
    assert traj.response_length == chunks[-1].usage.completion_tokens
    assert chat.decode_turn(traj.response_ids) == text, "the session recorded exactly the streamed answer"


async def test_async_client_streaming_and_divergent_history(tmp_path, nats_server, warm_engine):
    async with running_service(idle_cfg(tmp_path, nats_server.url, warm_engine)) as (svc, url):
        sess = await new_session(url)
        client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120)
        messages = [{"role": "user", "content": QUESTION}]
        chunks = [c async for c in await client.chat.completions.create(model="p", messages=messages, tools=CALC, temperature=0,
                                                                         max_tokens=64, stream=True)]
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls and calls[0].function.name == "calculator"
        # the client rewrites history (drops the assistant turn): a new segment, reported
        edited = [{"role": "user", "content": "What is 416 - 942 - 804? Use the calculator tool, then answer with \\boxed{N}."}]
        await client.chat.completions.create(model="p", messages=edited, tools=CALC, temperature=0, max_tokens=32)
        async with httpx.AsyncClient() as http:
            state = (await http.get(f"{url}/v1/sessions/{sess['id']}", headers={"Authorization": f"Bearer {sess['token']}"})).json()
        assert state["segments"] == 2 and "recorded" in state["divergences"][0]["reason"]


# tool_choice "required" / named: the service appends the opening of a call to the prompt and the
# engine continues from there (docs/openai_api.md). What the continuation is, is up to the model —
# an untrained one may stop at once — so the engine's answers to forced turns are scripted here:
# "required" gets a complete call, the named choice an immediate EOS.
FORCED_OPENING = '<tool_call>\n{"name": "'
NAMED_OPENING = FORCED_OPENING + 'calculator", "arguments": '
SCRIPTED_CONTINUATION = 'calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


def scripted_forced_turns(chat: ChatTokenizer):
    """A RecordingProxy intercept for /generate: a prompt ending with :data:`FORCED_OPENING` gets
    :data:`SCRIPTED_CONTINUATION` + EOS, one ending with :data:`NAMED_OPENING` EOS alone; everything
    else is forwarded to the engine."""
    scripted = {tuple(chat.encode_text(FORCED_OPENING)): chat.encode_text(SCRIPTED_CONTINUATION) + [chat.eos_token_id],
                tuple(chat.encode_text(NAMED_OPENING)): [chat.eos_token_id]}

    def intercept(method, path, body):
        ids = (body.get("input_ids") or []) if path == "/generate" and isinstance(body, dict) else []
        continuation = next((out for opening, out in scripted.items() if tuple(ids[-len(opening):]) == opening), None)
        if continuation is None:
            return None
        return 200, generate_answer(chat, body, continuation)

    return intercept


async def test_stateless_routes_and_completions(tmp_path, nats_server, warm_engine, warm_model):
    chat_tok = ChatTokenizer(load_tokenizer(str(warm_model)), CALC)
    proxy = await RecordingProxy(warm_engine).start()
    proxy.intercept = scripted_forced_turns(chat_tok)
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            client = OpenAI(base_url=f"{url}/v1", api_key=API, timeout=120)
            chat = await _in_thread(lambda: client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": QUESTION}], tools=CALC, tool_choice="none", max_tokens=20,
                temperature=0, logprobs=True, top_logprobs=3))
            assert chat.choices[0].message.tool_calls is None and len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
            forced = await _in_thread(lambda: client.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hello"}], tools=CALC, tool_choice="required", max_tokens=40,
                temperature=0))
            assert forced.choices[0].message.tool_calls or forced.choices[0].finish_reason == "length"
            call = forced.choices[0].message.tool_calls[0]
            assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "calculator"
            assert json.loads(call.function.arguments) == {"expression": "2 + 3"}
            forced_prompt = chat_tok.prompt_ids([{"role": "user", "content": "hello"}]) + chat_tok.encode_text(FORCED_OPENING)
            sent = [body["input_ids"] for _, path, _, body in proxy.requests if path == "/generate"]
            assert forced_prompt in sent, "the engine continues the prompt plus the forced opening"
            import openai

            named_kwargs = dict(model="p", messages=[{"role": "user", "content": "hello"}], tools=CALC, max_tokens=40,
                                temperature=0, tool_choice={"type": "function", "function": {"name": "calculator"}})
            # OpenAI promises a call: a model that ends the turn inside the forced call is an explicit 422
            with pytest.raises(openai.UnprocessableEntityError) as unmet:
                await _in_thread(lambda: client.with_options(max_retries=0).chat.completions.create(**named_kwargs))
            err = unmet.value.body
            assert err["code"] == "tool_choice_not_satisfied" and err["param"] == "tool_choice" and "stopped" in err["message"]
            comp = await _in_thread(lambda: client.completions.create(model="p", prompt="The answer is", max_tokens=5, temperature=0,
                                                                      logprobs=2))
            assert comp.choices[0].text and len(comp.choices[0].logprobs.tokens) == comp.usage.completion_tokens
            by_ids = await _in_thread(lambda: client.completions.create(model="p", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0))
            assert by_ids.usage.prompt_tokens == 4
            streamed = await _in_thread(lambda: list(client.completions.create(model="p", prompt="The answer is", max_tokens=5,
                                                                               stream=True)))
            assert streamed[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        await proxy.stop()


async def _in_thread(fn):
    import asyncio

    return await asyncio.to_thread(fn)


REFUSED = [
    ({"n": 2}, "n > 1"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ({"top_logprobs": 3}, "requires logprobs"),
    ({"max_tokens": 10**7}, "exceeds the limit"),
    ({"temperature": 5}, "temperature"),
    ({"tool_choice": "required"}, "needs tools"),
]


async def test_unsupported_or_invalid_parameters_are_rejected_clearly(tmp_path, nats_server, warm_engine):
    """Each case against one service (none of them changes its state)."""
    import openai

    async with running_service(idle_cfg(tmp_path, nats_server.url, warm_engine)) as (svc, url):
        client = OpenAI(base_url=f"{url}/v1", api_key=API, timeout=60, max_retries=0)
        for kwargs, fragment in REFUSED:
            with pytest.raises(openai.BadRequestError) as err:
                await _in_thread(lambda kw=kwargs: client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], **kw))
            assert fragment in str(err.value), (kwargs, str(err.value))
