"""verifiers environments as the source of trajectories (``data.source = "verifiers:..."``):
the rollout service starts the driver itself, the environment's episodes become sessions,
and what is published is token-exact, grouped, and scored by the environment's rubric.

The environment is tests/rollout/verifiers_arith.py. What "the engine" answers is scripted
(tests/helpers/scripted_engine.py): the tool call with the question's expression, then the
boxed tool result; so every reward is known in advance and nothing depends on a model.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from asyncrl.chat import ChatTokenizer
from asyncrl.models import load_tokenizer
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.scripted_engine import scripted_generate
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN, consume_as_trainer, running_service, service_config
from tests.rollout.test_service_episodes import fetch_all, model_segments
from tests.rollout.verifiers_arith import calculator, question_of

pytest.importorskip("verifiers", reason="the verifiers extra (asyncrl[verifiers]) is a dev dependency: ./dev install")

ENV = "tests.rollout.verifiers_arith"
API = "data-plane-token-0123456789"
FINISH_S = 120.0


def tool_then_answer(text: str) -> str | None:
    """The scripted model: after a tool result, box it; otherwise call the calculator on the question."""
    if text.rstrip().endswith("<|im_start|>assistant") and "<tool_response>" in text.split("<|im_start|>user")[-1]:
        result = text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
        return f"The answer is \\boxed{{{result}}}."
    expr = question_of(text)
    if expr is None:
        return None
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expr + '"}}\n</tool_call>'


def direct_answer(text: str) -> str | None:
    expr = question_of(text)
    return None if expr is None else f"\\boxed{{{calculator(expr)}}}"


def vf_config(tmp_path, nats_url, engine_url, kind: str, groups: int, *extra: str):
    return service_config(tmp_path, nats_url, [engine_url], f"data.source=verifiers:{ENV}",
                          f'data.source_options={{"kind": "{kind}", "rows_n": 3}}', f"rollout.total_rollout_steps={groups}",
                          "rollout.n=2", "async_training.staleness_threshold=50", f"security.api_token={API}",
                          "api.model_name=policy", "rollout.sampling.max_new_tokens=64", *extra)


async def status(url: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/admin/status", headers={"Authorization": f"Bearer {ADMIN}"})).json()


async def scripted_proxy(warm_engine, warm_model, answer):
    proxy = await RecordingProxy(warm_engine).start()
    chat = ChatTokenizer(load_tokenizer(str(warm_model)), [])
    log: list = []
    proxy.intercept = scripted_generate(chat, answer, log)
    return proxy, chat, log


def driver_finished(svc) -> bool:
    st = svc.env_driver.status() if svc.env_driver is not None else {}
    assert st.get("state") not in ("failed",), st
    return st.get("state") == "finished"


async def test_tool_env_episodes_are_published_token_exact_with_the_rubrics_reward(tmp_path, nats_server, warm_engine, warm_model):
    proxy, chat, log = await scripted_proxy(warm_engine, warm_model, tool_then_answer)
    try:
        async with running_service(vf_config(tmp_path, nats_server.url, proxy.url, "tools", 2)) as (svc, url):
            await wait_for(lambda: driver_finished(svc), FINISH_S, "the verifiers driver to play its 2 groups")
            st = await status(url)
            trajs = await fetch_all(nats_server.url, "demo", 4)
    finally:
        await proxy.stop()
    env = st["environment"]
    assert env["state"] == "finished" and env["groups_started"] == env["groups_finished"] == 2 and env["restarts"] == 0, env
    assert env["episodes_failed"] == 0 and env["sessions_open"] == 0, env
    assert st["prompts"]["produced"] == st["prompts"]["total"] == 2 and st["counts"]["active"] == 0
    assert len(trajs) == 4 and {t.data_source for t in trajs} == {f"verifiers/{ENV}"}
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    assert sorted(groups) == ["x:vf00000000", "x:vf00000001"]  # session groups, namespaced
    for members in groups.values():
        assert sorted(t.group_index for t in members) == [0, 1] and {t.group_size for t in members} == {2}
    for t in trajs:
        assert not t.failure and t.num_turns == 2 and t.metadata["segments"] == 1 and t.metadata["divergences"] == []
        # rubric: correct (1.0) + 0.5 * brief (1.0); ToolEnv's monitoring metrics are components with weight 0
        assert t.reward == pytest.approx(1.5)
        assert t.reward_details["correct"] == 1.0 and t.reward_details["brief"] == 1.0
        assert t.reward_details["calculator_calls"] == 1.0 and t.reward_details["total_tool_calls"] == 1.0
        assert [m["role"] for m in t.messages][-3:] == ["assistant", "tool", "assistant"]
        # token-exact: each model turn is exactly what the (scripted) engine returned, after exactly the tokens recorded before it
        mine = [(req, resp) for req, resp in log if f".{t.id}." in req["rid"]]
        segs = model_segments(t)
        assert len(mine) == len(segs) == 2
        for (start, end), (req, resp) in zip(segs, mine):
            assert t.response_ids[start:end] == resp["output_ids"]
            assert t.rollout_logprobs[start:end] == [lp for lp, _, _ in resp["meta_info"]["output_token_logprobs"]]
            assert req["input_ids"] == t.token_ids[: t.prompt_length + start]
        assert "Use the calculator" in chat.decode(t.token_ids[: t.prompt_length])  # the environment's system prompt


async def test_single_turn_env_keeps_every_rubric_component(tmp_path, nats_server, warm_engine, warm_model):
    proxy, _chat, _log = await scripted_proxy(warm_engine, warm_model, direct_answer)
    try:
        async with running_service(vf_config(tmp_path, nats_server.url, proxy.url, "single", 1,
                                             'rollout.publish_unit=group')) as (svc, _url):
            await wait_for(lambda: driver_finished(svc), FINISH_S, "the verifiers driver to play its group")
            trajs = await fetch_all(nats_server.url, "demo", 2)
    finally:
        await proxy.stop()
    assert len(trajs) == 2 and {t.group_id for t in trajs} == {"x:vf00000000"}
    for t in trajs:
        assert t.num_turns == 1 and t.num_tool_calls == 0 and not t.failure
        assert t.reward_details == {"correct": 1.0, "brief": 1.0, "num_turns": 1.0} and t.reward == pytest.approx(1.5)


async def test_a_failing_rubric_is_published_as_reward_error_never_as_a_reward(tmp_path, nats_server, warm_engine, warm_model):
    proxy, _chat, _log = await scripted_proxy(warm_engine, warm_model, direct_answer)
    try:
        async with running_service(vf_config(tmp_path, nats_server.url, proxy.url, "bad_rubric", 1)) as (svc, url):
            await wait_for(lambda: driver_finished(svc), FINISH_S, "the verifiers driver to play its group")
            env = (await status(url))["environment"]
            trajs = await fetch_all(nats_server.url, "demo", 2)
    finally:
        await proxy.stop()
    assert env["episodes_failed"] == 2, env
    assert [t.failure for t in trajs] == ["reward_error", "reward_error"]
    assert all("broken on purpose" in t.reward_details["error"] for t in trajs)


async def test_backpressure_holds_the_next_group_until_the_version_moves(tmp_path, nats_server, warm_engine, warm_model,
                                                                         install_version):
    """Staleness 0 with a mini-batch of one sample: one group per weight version. The driver's
    second group is refused (429) until the version moves, then it plays."""
    proxy, _chat, _log = await scripted_proxy(warm_engine, warm_model, direct_answer)
    cfg = vf_config(tmp_path, nats_server.url, proxy.url, "single", 2, "async_training.staleness_threshold=0",
                    "actor.ppo_mini_batch_size=1")
    try:
        async with running_service(cfg) as (svc, url):
            await wait_for(lambda: (svc.env_driver.progress() or None) and svc.env_driver.progress().finished == 1, FINISH_S,
                           "the first group to be played")
            blocked = svc.runner.admission_blocker(external=True) or ""
            assert "queue full" in blocked or "quota" in blocked, blocked
            assert svc.env_driver.progress().started == 1  # the second group waits for its admission
            assert await consume_as_trainer(nats_server.url, "demo") == 2  # the trainer takes the first group
            await install_version(warm_engine, 1)  # the sync
            async with httpx.AsyncClient() as http:
                for path in ("/admin/pause", "/admin/resume"):
                    body = {"mode": "drain"} if path == "/admin/pause" else {"version": 1}
                    r = await http.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
                    assert r.status_code == 200, r.text
            await wait_for(lambda: driver_finished(svc), FINISH_S, "the second group, after the version moved")
    finally:
        await proxy.stop()


async def test_a_killed_driver_is_restarted_and_closes_what_it_left_open(tmp_path, nats_server, warm_engine, warm_model):
    proxy, chat, log = await scripted_proxy(warm_engine, warm_model, direct_answer)
    scripted = proxy.intercept
    proxy.intercept = None  # the first episodes reach the engine and wait there (hold)
    proxy.hold = asyncio.Event()
    try:
        cfg = vf_config(tmp_path, nats_server.url, proxy.url, "single", 3, "rollout.max_concurrent=2")  # a group at a time
        async with running_service(cfg) as (svc, url):
            await wait_for(lambda: proxy.held >= 2, FINISH_S, "the first group's two episodes to be generating")
            first = svc.env_driver.proc.pid
            left_open = dict(svc.env_driver.progress().open_sessions)
            assert len(left_open) == 2
            os.kill(first, signal.SIGKILL)
            await wait_for(lambda: svc.env_driver.restarts == 1 and svc.env_driver.proc.pid != first, 60,
                           "the supervisor to restart the driver")
            proxy.intercept = scripted
            proxy.hold.set()
            await wait_for(lambda: driver_finished(svc), FINISH_S, "the restarted driver to play the other groups")
            env = (await status(url))["environment"]
            closed = {sid: svc.sessions.sessions[sid].status for sid in left_open}
            trajs = await fetch_all(nats_server.url, "demo", 4)
    finally:
        await proxy.stop()
    assert env["restarts"] == 1 and env["groups_started"] == 3 and env["sessions_open"] == 0, env
    assert set(closed.values()) <= {"finished", "failed"}, closed  # closed at once, not left to expire
    by_group = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    assert sorted(by_group) in (["x:vf00000001", "x:vf00000002"], ["x:vf00000000", "x:vf00000001", "x:vf00000002"])
    assert all(t.failure == "agent_crash" for t in by_group.get("x:vf00000000", []))  # never trained
    assert all(not t.failure and t.reward == pytest.approx(1.5) for g in ("x:vf00000001", "x:vf00000002") for t in by_group[g])


async def test_an_environment_that_cannot_load_is_reported_not_restarted(tmp_path, nats_server, warm_engine):
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "data.source=verifiers:no_such_environment_module",
                         f"security.api_token={API}")
    async with running_service(cfg) as (svc, url):
        await wait_for(lambda: svc.env_driver.state == "failed", 60, "the driver to give up on the environment")
        st = await status(url)
    env = st["environment"]
    assert env["restarts"] == 0 and "no_such_environment_module" in env["last_error"], env
    assert any(w["component"] == "verifiers driver" for w in st["health"]["warnings"] + st["health"].get("stuck", [])), st["health"]


async def test_a_setting_the_openai_api_cannot_carry_is_refused_at_start(tmp_path, nats_server, warm_engine):
    from rollout_service.build import build

    cfg = service_config(tmp_path, nats_server.url, [warm_engine], f"data.source=verifiers:{ENV}", "rollout.sampling.top_k=5")
    with pytest.raises(ValueError, match="top_k"):
        await build(cfg)
