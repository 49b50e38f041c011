"""The rollout service end to end with a real nats-server and real engine processes:
published trajectories are exact records of the conversation and of what the engine returned."""

from __future__ import annotations

from asyncrl.chat import ChatTokenizer
from asyncrl.jetstream import connect
from asyncrl.models import load_tokenizer
from asyncrl.wire import NatsNames, decode_trajectory, is_end_of_data
from rollout_service.prompts import validation_records
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import running_service, service_config
from tools.calculator import CalculatorError, evaluate_expression, format_number
from tools.registry import ToolRegistry


async def fetch_all(nats_url: str, run_id: str, expected: int, timeout_s: float = 180.0):
    nc = await connect(nats_url, "test-reader", persistent=False)
    js = nc.jetstream()
    names = NatsNames(run_id)
    sub = await js.pull_subscribe(names.trajectories, durable=None)
    out = []

    async def fetched_all() -> bool:
        try:
            out.extend(decode_trajectory(m.data) for m in await sub.fetch(50, timeout=1) if not is_end_of_data(m.headers))
        except TimeoutError:
            pass
        return len(out) >= expected

    try:
        await wait_for(fetched_all, timeout_s, f"{expected} trajectories of run {run_id} in the stream", interval_s=0)
        # anything beyond `expected` (a duplicate) would show up here
        try:
            out += [decode_trajectory(m.data) for m in await sub.fetch(50, timeout=1) if not is_end_of_data(m.headers)]
        except TimeoutError:
            pass
    finally:
        await nc.close()
    return out


async def _is_empty(nats_url: str, bucket: str) -> bool:
    nc = await connect(nats_url, "test-inspect", persistent=False)
    try:
        return (await nc.jetstream().stream_info(f"KV_{bucket}")).state.messages == 0
    finally:
        await nc.close()


def model_segments(traj):
    """(start, end) of runs of loss-mask 1 in the response."""
    segs, start = [], None
    for i, m in enumerate(traj.loss_mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            segs.append((start, i))
            start = None
    return segs


async def test_group_with_tool_calls_is_published_once_and_exactly(tmp_path, nats_server, warm_engine, warm_model):
    proxy = await RecordingProxy(warm_engine).start()
    cfg = service_config(tmp_path, nats_server.url, [proxy.url], "rollout.n=3", "rollout.total_rollout_steps=2",
                         "rollout.sampling.temperature=0", "rollout.sampling.max_new_tokens=48",
                         "rollout.multi_turn.max_assistant_turns=3", "rollout.response_length=200")
    try:
        async with running_service(cfg) as (svc, _url):
            await wait_for(lambda: svc.runner.counters.trajectories_finished >= 6, 240, "6 finished trajectories")
            await wait_for(lambda: svc.runner.publisher.stats.published >= 6, 60, "6 published trajectories")
            wasted = svc.runner.tokens.wasted
            # finished agents leave nothing in the agents bucket (no KV delete markers)
            bucket = NatsNames(cfg.run.id).agents_bucket
            await wait_for(lambda: _is_empty(nats_server.url, bucket), 30, "the agents bucket empty", interval_s=0.2)
        trajs = await fetch_all(nats_server.url, cfg.run.id, 6)
    finally:
        await proxy.stop()
    assert len(trajs) == 6 and len({t.id for t in trajs}) == 6, "each trajectory published exactly once"
    groups = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t.group_index)
    assert sorted(map(sorted, groups.values())) == [[0, 1, 2], [0, 1, 2]]
    assert wasted == 0

    chat = ChatTokenizer(load_tokenizer(str(warm_model)), ToolRegistry.from_names(["calculator"]).schemas())
    by_rid = {}
    for req, resp in proxy.exchanges:
        by_rid[req["rid"]] = (req, resp)
    for t in trajs:
        assert t.num_tool_calls >= 1, f"{t.id} made no tool call: {t.messages}"
        assert t.weight_versions and set(v for v in t.weight_versions if v != -1) == {0}
        # the prompt is the chat template's rendering of the dataset prompt (with tools)
        user = [m for m in t.messages if m["role"] == "user"][:1]
        assert chat.decode(t.token_ids[: t.prompt_length]) == chat.decode(chat.prompt_ids(user))
        resp_ids = t.response_ids
        segs = model_segments(t)
        # every model segment is exactly one engine answer: same ids, same logprobs
        exchanges = [by_rid[r] for r in sorted(by_rid) if r.startswith(f"rl-{cfg.run.id}.{t.id}.")]
        assert len(exchanges) == len(segs)
        for (start, end), (req, resp) in zip(segs, exchanges):
            triples = resp["meta_info"]["output_token_logprobs"]
            assert resp_ids[start:end] == [tr[1] for tr in triples]
            assert t.rollout_logprobs[start:end] == [tr[0] for tr in triples]
            assert req["input_ids"] == t.token_ids[: t.prompt_length + start], "generation by token ids of the sequence so far"
        # loss mask 0 exactly on the tool segments, which render the calculator's real answer
        env_runs = [(a, b) for a, b in zip([e for _, e in segs], [s for s, _ in segs[1:]] + [t.response_length]) if a < b]
        calls = [c for m in t.messages if m["role"] == "assistant" for c in m.get("tool_calls", [])]
        tool_msgs = [m for m in t.messages if m["role"] == "tool"]
        assert len(env_runs) == len(tool_msgs) == len(calls) or t.finish_reason in ("length", "turn_limit")
        for (a, b), call, tool_msg in zip(env_runs, calls, tool_msgs):
            import json

            expr = json.loads(call["function"]["arguments"]).get("expression", "")
            try:
                expected = format_number(evaluate_expression(expr))
            except CalculatorError:
                expected = None
            if expected is not None:
                assert tool_msg["content"] == expected
            assert set(t.loss_mask[a:b]) == {0} and set(t.weight_versions[a:b]) == {-1}
            assert chat.decode(resp_ids[a:b]) == chat.decode(chat.environment_segment([tool_msg]))


async def test_validation_runs_greedy_on_the_val_set_and_publishes_metrics(tmp_path, nats_server, warm_engine,
                                                                          install_version):
    import json as _json

    import aiohttp

    from tests.rollout.conftest import admin

    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1", "rollout.test_freq=2",
                         "rollout.val_before_train=true")
    nc = await connect(nats_server.url, "metrics-reader", persistent=False)
    seen: list[dict] = []

    async def on_metrics(msg):
        seen.append(_json.loads(msg.data))

    sub = await nc.subscribe(NatsNames(cfg.run.id).metrics("rollout"), cb=on_metrics)
    try:
        async with running_service(cfg) as (svc, url), aiohttp.ClientSession() as http:
            # val_before_train: once at version 0 by itself, before anyone asks
            await wait_for(lambda: any(d.get("kind") == "validation" and d["version"] == 0 for d in seen), 180,
                           "the validation before training")
            status, body = await admin(http, "POST", f"{url}/admin/validate")
            assert status == 200 and body["kind"] == "validation" and body["samples"] == len(validation_records(cfg.data, cfg.run_dir)) > 0
            key = "val-core/asyncrl/arith/reward/mean@1"
            assert 0.0 <= body["metrics"][key] <= 1.0 and body["metrics"]["val-aux/num_tool_calls/mean"] > 0
            # every test_freq versions it runs by itself after a resume
            await install_version(warm_engine, 2)  # the sync
            assert (await admin(http, "POST", f"{url}/admin/resume", {"version": 2}))[0] == 200
            await wait_for(lambda: (svc.runner.snapshot().last_validation or {}).get("version") == 2, 180, "validation at version 2")
            await wait_for(lambda: any(d.get("kind") == "validation" and d["version"] == 2 for d in seen), 30, "published")
            await wait_for(lambda: any(d.get("kind") == "rollout" and "rollouter/idle_ratio" in d["metrics"] for d in seen), 30,
                           "periodic rollout metrics")
    finally:
        await sub.unsubscribe()
        await nc.close()


async def test_a_crashing_reward_function_marks_the_trajectories_untrainable(tmp_path, nats_server, warm_engine, monkeypatch):
    """A reward function that raises is an infrastructure failure, not a zero reward: the
    trajectories are published (exactly once, as always) with ``failure="reward_error"`` and
    the error in their details, counted per reason; the trainer never trains them."""
    import rollout_service.build as service_mod
    from rollout_service.rewards import ARITH_DATA_SOURCE

    def crashing(response_text, ground_truth, extra_info):
        raise RuntimeError("the grader's database is down")

    def registry_with_crash(math, **kwargs):
        registry = default_registry(math, **kwargs)
        registry.register(ARITH_DATA_SOURCE, crashing, replace=True)
        return registry

    default_registry = service_mod.default_registry
    monkeypatch.setattr(service_mod, "default_registry", registry_with_crash)
    cfg = service_config(tmp_path, nats_server.url, [warm_engine], "rollout.total_rollout_steps=1", "rollout.n=2",
                         "rollout.sampling.temperature=0", "rollout.sampling.max_new_tokens=16")
    async with running_service(cfg) as (svc, url):
        await wait_for(lambda: svc.runner.counters.trajectories_finished == 2, 180, "the group to finish")
        assert svc.runner.counters.failures == {"reward_error": 2}
    trajs = await fetch_all(nats_server.url, cfg.run.id, 2)
    assert len(trajs) == 2 and {t.failure for t in trajs} == {"reward_error"}
    assert all("database is down" in t.reward_details["error"] and t.reward == 0.0 for t in trajs)
