"""External tools: an environment process in plain HTTP answers calls that internal agents
park; replays, conflicts, unknown calls, deadlines, a pause and a restart while parked."""

from __future__ import annotations

import json
import sys

import aiohttp
import httpx

from asyncrl.launch import ChildProcess, free_port, http_ok
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN, admin, running_service, service_config
from tests.rollout.test_service_episodes import fetch_all

API = "data-plane-token-0123456789"
EXAMPLE = "examples/external_environment.py"


def ext_tool(deadline_s: float = 60.0, on_timeout: str = "error") -> str:
    tool = {"name": "calculator", "description": "Evaluate an arithmetic expression exactly as written and return the number.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
            "environment": "arith", "deadline_s": deadline_s, "on_timeout": on_timeout}
    return "rollout.external_tools=" + json.dumps([tool])


def cfg_for(tmp_path, nats_url, engine, *extra):
    return service_config(tmp_path, nats_url, [engine], "rollout.tools=[]", "rollout.n=2", "rollout.total_rollout_steps=2",
                          "rollout.sampling.temperature=0", "rollout.multi_turn.max_assistant_turns=2",
                          "async_training.staleness_threshold=10", f"security.api_token={API}", *extra)


async def poll_calls(url: str, n: int, timeout_s: float = 120) -> list[dict]:
    seen: dict[tuple, dict] = {}
    async with httpx.AsyncClient(timeout=60) as http:

        async def announced() -> bool:  # a long poll: it waits up to 5 s for new calls itself
            r = await http.get(f"{url}/v1/environments/arith/tool_calls", params={"wait": 5}, headers={"Authorization": f"Bearer {API}"})
            assert r.status_code == 200, r.text
            for c in r.json()["tool_calls"]:
                seen[(c["session_id"], c["tool_call_id"])] = c
            return len(seen) >= n

        await wait_for(announced, timeout_s, f"{n} parked calls to be announced", interval_s=0)
    return list(seen.values())


async def test_environment_process_serves_parked_calls(tmp_path, nats_server, warm_engine):
    cfg = cfg_for(tmp_path, nats_server.url, warm_engine, ext_tool())
    async with running_service(cfg) as (svc, url):
        env = ChildProcess("env", [sys.executable, EXAMPLE, "--url", url, "--environment", "arith", "--api-token", API],
                           tmp_path / "env.log").start()
        try:
            await wait_for(lambda: svc.runner.counters.trajectories_finished == 4, 180, "episodes served by the environment")
        finally:
            env.stop()
        assert svc.broker.expired_calls == 0
        log = (tmp_path / "env.log").read_text()
        assert '"status": 200' in log
    trajs = await fetch_all(nats_server.url, cfg.run.id, 4)
    for t in trajs:
        calls = [c for m in t.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
        results = [m["content"] for m in t.messages if m["role"] == "tool"]
        assert calls and results and not any(r.startswith("Error: the") for r in results)


async def test_replay_conflict_unknown_and_pause_while_parked(tmp_path, nats_server, warm_engine, install_version):
    cfg = cfg_for(tmp_path, nats_server.url, warm_engine, ext_tool())
    async with running_service(cfg) as (svc, url), httpx.AsyncClient(timeout=60) as http, aiohttp.ClientSession() as adm:
        calls = await poll_calls(url, 4)
        status, body = await admin(adm, "POST", f"{url}/admin/pause", {"mode": "partial"})
        assert status == 200 and body["counts"]["parked"] == 4 and body["counts"]["generating"] == 0
        first = calls[0]
        path = f"{url}/v1/sessions/{first['session_id']}/tool_results"
        auth = {"Authorization": f"Bearer {first['token']}"}
        ok = await http.post(path, json={"tool_call_id": first["tool_call_id"], "content": "42"}, headers=auth)
        assert ok.status_code == 200 and ok.json() == {"accepted": True, "duplicate": False}
        replay = await http.post(path, json={"tool_call_id": first["tool_call_id"], "content": "42"}, headers=auth)
        assert replay.status_code == 200 and replay.json()["duplicate"] is True
        conflict = await http.post(path, json={"tool_call_id": first["tool_call_id"], "content": "43"}, headers=auth)
        assert conflict.status_code == 409 and "different result" in conflict.json()["error"]["message"]
        unknown = await http.post(path, json={"tool_call_id": "call_9_9", "content": "1"}, headers=auth)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
        wrong = await http.post(path, json={"tool_call_id": first["tool_call_id"], "content": "42"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        none = await http.post(path, json={"tool_call_id": first["tool_call_id"], "content": "42"})
        assert none.status_code == 401
        nosess = await http.post(f"{url}/v1/sessions/nope/tool_results", json={"tool_call_id": "x", "content": "1"}, headers=auth)
        assert nosess.status_code == 403  # an unknown session is not told apart from a wrong token (issue 30 item 11)
        bad = await http.post(path, content=b"{oops", headers={**auth, "Content-Type": "application/json"})
        assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
        await install_version(warm_engine, 1)  # the sync
        status, body = await admin(adm, "POST", f"{url}/admin/resume", {"version": 1})
        assert status == 200
        for c in calls[1:]:
            r = await http.post(f"{url}/v1/sessions/{c['session_id']}/tool_results",
                                json={"tool_call_id": c["tool_call_id"], "content": "7"}, headers={"Authorization": f"Bearer {c['token']}"})
            assert r.status_code == 200
        await wait_for(lambda: svc.runner.counters.trajectories_finished == 4, 120, "episodes after the results")
    trajs = await fetch_all(nats_server.url, cfg.run.id, 4)
    answered = next(t for t in trajs if t.id == first["session_id"])
    assert [m["content"] for m in answered.messages if m["role"] == "tool"][0] == "42", "the replayed result is used once"


async def test_deadline_gives_an_error_result_or_ends_the_episode(tmp_path, nats_server, warm_engine):
    cfg = cfg_for(tmp_path, nats_server.url, warm_engine, ext_tool(deadline_s=1.5, on_timeout="error"))
    async with running_service(cfg) as (svc, url), httpx.AsyncClient(timeout=60) as http:
        calls = await poll_calls(url, 1)
        await wait_for(lambda: svc.broker.expired_calls >= 1, 60, "a deadline to pass")
        c = calls[0]
        late = await http.post(f"{url}/v1/sessions/{c['session_id']}/tool_results",
                               json={"tool_call_id": c["tool_call_id"], "content": "1"}, headers={"Authorization": f"Bearer {c['token']}"})
        assert late.status_code == 409 and "deadline passed" in late.text, late.text
        await wait_for(lambda: svc.runner.counters.trajectories_finished == 4, 120, "episodes after the deadlines")
        later = await http.post(f"{url}/v1/sessions/{c['session_id']}/tool_results",
                                json={"tool_call_id": c["tool_call_id"], "content": "1"}, headers={"Authorization": f"Bearer {c['token']}"})
        assert later.status_code == 409, "the episode has finished: the retry still hears why"
    trajs = await fetch_all(nats_server.url, cfg.run.id, 4)
    assert all(any(m["role"] == "tool" and "did not answer" in m["content"] for m in t.messages) for t in trajs)

    cfg2 = cfg_for(tmp_path / "abort", nats_server.url, warm_engine, ext_tool(deadline_s=1.0, on_timeout="abort"), "run.id=abort")
    async with running_service(cfg2) as (svc, url):
        await wait_for(lambda: svc.runner.counters.trajectories_finished == 4, 120, "episodes ended at the deadline")
        assert svc.runner.counters.finish_reasons == {"expired": 4}
        assert svc.runner.counters.failures == {"environment_expired": 4}
        async with httpx.AsyncClient(timeout=30) as http:
            metrics = (await http.get(f"{url}/metrics")).text
        assert 'asyncrl_rollout_infra_failures_total{reason="environment_expired"} 4.0' in metrics
    expired = await fetch_all(nats_server.url, cfg2.run.id, 4)
    assert {t.failure for t in expired} == {"environment_expired"}, "an aborted episode is never trained"
    assert {t.failure for t in trajs} == {""}, "a deadline shown to the model as a tool error is the model's episode"


async def test_parked_calls_survive_a_restart_of_the_service(tmp_path, nats_server, warm_engine):
    cfg_path = tmp_path / "rollout.json"
    tool = json.loads(ext_tool().split("=", 1)[1])
    cfg_path.write_text(json.dumps({
        "run": {"dir": str(tmp_path / "run")}, "nats": {"url": nats_server.url}, "engines": {"urls": [warm_engine]},
        "security": {"admin_token": ADMIN, "api_token": API},
        "rollout": {"n": 2, "total_rollout_steps": 2, "tools": [], "external_tools": tool, "sampling": {"temperature": 0},
                    "multi_turn": {"max_assistant_turns": 2}},
        "actor": {"ppo_mini_batch_size": 2}, "async_training": {"staleness_threshold": 10},
    }))
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def start(i: int) -> ChildProcess:
        proc = ChildProcess("rollout", [sys.executable, "-m", "launcher", "rollout", str(cfg_path), f"rollout.port={port}"],
                            tmp_path / f"rollout-{i}.log").start()
        proc.wait_ready(lambda: http_ok(f"{url}/health"), 120)
        return proc

    def post(http, c, content, token=None, is_error=False):
        return http.post(f"{url}/v1/sessions/{c['session_id']}/tool_results",
                         json={"tool_call_id": c["tool_call_id"], "content": content, "is_error": is_error},
                         headers={"Authorization": f"Bearer {token or c['token']}"})

    first = start(1)
    try:
        before = await poll_calls(url, 4)
        answered = before[0]
        async with httpx.AsyncClient(timeout=60) as http:
            r = await post(http, answered, "tool failed: division by zero", is_error=True)
            assert r.status_code == 200 and r.json() == {"accepted": True, "duplicate": False}
    finally:
        first.kill()  # at once: the agent may not have checkpointed the result; the call's record has it
    second = start(2)
    try:
        after = await poll_calls(url, 3)  # the other calls, re-announced from the checkpoints with fresh tokens
        keys = {(c["session_id"], c["tool_call_id"]) for c in after}
        assert keys == {(c["session_id"], c["tool_call_id"]) for c in before[1:]}, "the answered call is not asked again"
        async with httpx.AsyncClient(timeout=60) as http:
            again = await post(http, answered, "tool failed: division by zero", is_error=True)
            assert again.status_code == 200 and again.json()["duplicate"] is True, "a retry across the restart: same answer"
            other = await post(http, answered, "42")
            assert other.status_code == 409 and "different result" in other.json()["error"]["message"]
            old_tokens = {(c["session_id"], c["tool_call_id"]): c["token"] for c in before}
            for c in after:  # the tokens handed out before the restart still work for their calls
                r = await post(http, c, "5", token=old_tokens[(c["session_id"], c["tool_call_id"])])
                assert r.status_code == 200, r.text
            trajs = await fetch_all(nats_server.url, "demo", 4, timeout_s=120)
            assert len({t.id for t in trajs}) == 4 == len(trajs)
            late = await post(http, answered, "tool failed: division by zero", is_error=True)
            assert late.status_code == 200 and late.json()["duplicate"] is True, "after the episode finished: same answer"
            unknown = await post(http, {**answered, "tool_call_id": "call-never-made"}, "1")
            assert unknown.status_code == 404
        traj = next(t for t in trajs if t.id == answered["session_id"])
        tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
        assert tool_msgs[0]["content"] == "tool failed: division by zero" and tool_msgs[0]["is_error"] is True
        assert all(m["is_error"] is False for t in trajs if t.id != traj.id for m in t.messages if m["role"] == "tool")
    finally:
        second.stop()
