"""Issue 52: an OpenAI Agents SDK agent, unmodified, on a session: ``Runner.run`` with the SDK's
default model (the Responses API) on the session's base URL, a ``function_tool`` the agent
executes itself. The SDK sends the whole conversation back as input items each turn (no
``previous_response_id``): the session still records one segment, and the published
trajectory holds exactly the engine's token ids and log-probs with the tool output masked."""

from __future__ import annotations

from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from asyncrl.chat import ChatTokenizer
from asyncrl.models import load_tokenizer
from tests.helpers.recording_proxy import RecordingProxy
from tests.rollout.conftest import running_service
from tests.rollout.test_openai_api import (
    CALC,
    QUESTION,
    check_trajectory,
    finish,
    idle_cfg,
    new_session,
)
from tests.rollout.test_service_episodes import fetch_all
from tools.calculator import evaluate_expression, format_number


async def test_an_agents_sdk_agent_with_its_own_tool_is_recorded_token_for_token(tmp_path, nats_server, warm_engine, warm_model):
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    expressions: list[str] = []

    @function_tool(name_override="calculator", description_override=CALC[0]["function"]["description"])
    def calculator(expression: str) -> str:
        expressions.append(expression)
        return format_number(evaluate_expression(expression))

    proxy = await RecordingProxy(warm_engine).start()
    try:
        async with running_service(idle_cfg(tmp_path, nats_server.url, proxy.url)) as (svc, url):
            sess = await new_session(url, data_source="external/arith", group_size=1)
            client = AsyncOpenAI(base_url=sess["base_url"], api_key=sess["token"], timeout=120, max_retries=0)
            agent = Agent(name="arith", tools=[calculator], model=OpenAIResponsesModel(model="policy", openai_client=client),
                          model_settings=ModelSettings(temperature=0, max_tokens=64))
            result = await Runner.run(agent, QUESTION, max_turns=4)
            assert expressions, "the agent ran the tool itself"
            assert "boxed" in str(result.final_output), result.final_output
            state = await finish(url, sess, reward=1.0)
            assert state["turns"] == 2 and state["segments"] == 1 and state["divergences"] == [], state
        trajs = await fetch_all(nats_server.url, "demo", 2)
    finally:
        await proxy.stop()
    traj = next(t for t in trajs if t.id == sess["id"])
    mine = [resp for req, resp in proxy.exchanges if f".{traj.id}." in req["rid"]]
    engine_lps = [[t[0] for t in resp["meta_info"]["output_token_logprobs"]] for resp in mine]
    chat = ChatTokenizer(load_tokenizer(str(warm_model)), CALC)
    check_trajectory(traj, proxy, engine_lps, chat, [{"role": "user", "content": QUESTION}])
    assert 0 in traj.loss_mask and traj.loss_mask[0] == 1, "the tool output is in the response, masked"
