"""Issue 51: ``sync.pause_policy = "per_request"`` end to end on a local engine behind a recording
proxy: three calls in flight meet one sync, and each gets its own outcome — the nearly finished
one is kept at the engine (paused in the survivor mode, finished on the new weights with two
version spans), the young one is aborted by its exact rid (partial tokens kept, resent after the
sync), the one whose trajectory the trainer would drop for staleness is cancelled. No
abort-all reaches the engine; nothing stays paused.

The calls' agents are driven states (their versions and lengths set by the test, so each
outcome is certain); the engine holds the generations mid-way (failpoint ``local_engine.step``)
until the sync's pause has reached it, so the sync always meets all three in flight."""

from __future__ import annotations

import asyncio

import httpx

from asyncrl import failpoints
from asyncrl.wire.sync import SyncStatus
from rollout_service.agent.state import AgentState
from rollout_service.runner.inflight import TurnLengths
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import WAIT_S, wait_for
from tests.sync.conftest import (
    ENGINE_ARGS,
    engine_tokens_over,
    perturbed_weights,
    publisher,
    service_idle,
    stack,
    sync_through_the_held_step,
)
from trainer_daemon.sync.agent import sync_outcome_metrics

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG = 1500
STEP = "local_engine.step"
TARGET = 3  # the sync's version: a trajectory started at 0 lags 3 > ceil(0.5) + 1 = 2, the trainer's bound


def driven(agent_id: str, version_start: int | None, response: int) -> AgentState:
    """An agent state with ``response`` response tokens already decoded since ``version_start``."""
    state = AgentState(id=agent_id, run_id="t", group_id=agent_id, group_size=1, group_index=0, prompt_id=agent_id,
                       data_source="t")
    state.token_ids = list(PROMPT) + [11] * response
    state.prompt_length = state.turn_start = len(PROMPT)
    state.version_start = version_start
    return state


async def test_one_sync_keeps_resumes_and_cancels_by_each_calls_facts(tmp_path, nats_server):
    points = tmp_path / "failpoints"
    points.mkdir()
    with start_engine(tmp_path, *ENGINE_ARGS, env={failpoints.ENV_DIR: str(points)}, name="engine") as engine:
        proxy = await RecordingProxy(engine.url).start()
        try:
            async with stack(tmp_path, nats_server.url, [proxy.url], "async_training.partial_rollout=true",
                             "async_training.staleness_threshold=0.5", "rollout.total_rollout_steps=1", "rollout.n=1",
                             "sync.pause_policy=per_request") as (svc, rollout_url, agent, agent_url, cfg):
                assert agent.coordinator.pause_mode == "per_request" and agent.coordinator.plan.engine_mode == "in_place"
                await wait_for(lambda: service_idle(svc, engine), WAIT_S, "the service's own sample to finish")
                prefix = svc.runner.rid_prefix
                keep = driven("keep", 2, 2 * LONG)  # 2/3 of its response decoded already
                young = driven("young", 2, 0)  # just started: the rest belongs to the new weights
                stale = driven("stale", 0, 20)  # version 0: lags 3 at version 3, the trainer would drop it
                svc.runner.agents[stale.id] = stale  # the runner's own agent (a session's call is never cancelled)
                svc.runner.calls.turns, svc.runner.calls.decode_rate = TurnLengths(), None  # progress against the budget, no
                # estimate of tokens in flight, nothing projected: the driven facts alone decide
                generator = svc.runner.calls.routed(svc.pool)
                params = {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
                calls = {s.id: asyncio.create_task(generator.generate(s, PROMPT, params, f"{prefix}{s.id}"))
                         for s in (keep, young, stale)}
                await wait_for(lambda: engine_tokens_over(engine, 3 * len(PROMPT) + 30), WAIT_S, "all three to decode")
                (points / f"{STEP}.arm").touch()
                await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the generations")
                assert set(svc.runner.calls.calls) == {f"{prefix}{s}" for s in calls}
                pub = publisher(agent_url, cfg)
                try:
                    _, weights = perturbed_weights(3)
                    await sync_through_the_held_step(points, proxy, pub.publish(TARGET, weights))
                    rec = agent.coordinator.records[-1]
                    await wait_for(lambda: rec.done, 60, "the sync to finish")
                    assert rec.state == "succeeded", rec.error
                    outcome = rec.pause_outcome  # the rollout's decisions, kept with the sync record
                    assert (outcome.target_version, outcome.kept, outcome.resumed, outcome.cancelled) == (TARGET, 1, 1, 1)
                    step_metrics = sync_outcome_metrics(SyncStatus.model_validate(rec.public()))  # what trainer.jsonl gets
                    assert step_metrics["fully_async/per_request/cancelled"] == 1.0
                    assert step_metrics["fully_async/per_request/cancelled_tokens"] >= 20
                    assert step_metrics["timing_s/sync_pausing"] > 0
                finally:
                    await pub.close()
                results = {k: await asyncio.wait_for(t, 180) for k, t in calls.items()}
                snap = svc.runner.snapshot()
                assert not snap.paused and snap.version == TARGET
                counts = snap.counters
                assert counts.per_request_calls == {"kept": 1, "resumed": 1, "cancelled": 1, "missed": 0}
                assert counts.per_request_pauses == 1 and counts.reprefill_tokens >= len(PROMPT)
                async with httpx.AsyncClient(timeout=30) as http:
                    metrics = (await http.get(f"{rollout_url}/metrics")).text
                for outcome, n in (("kept", 1), ("resumed", 1), ("cancelled", 1), ("missed", 0)):
                    assert f'asyncrl_rollout_per_request_calls_total{{outcome="{outcome}"}} {n}.0' in metrics
                assert f"asyncrl_rollout_reprefill_tokens_total {float(counts.reprefill_tokens)}" in metrics
        finally:
            await proxy.stop()
    kept, resumed, cancelled = results["keep"], results["young"], results["stale"]
    # kept: never aborted, finished after the sync with the new weights' tail (engine paused in_place)
    spans = [(s.version, s.start, s.end) for s in kept.weight_versions]
    assert kept.finish_reason.type == "length" and len(kept.output_ids) == LONG
    assert len(spans) == 2 and spans[0][0] == 0 and spans[1][0] == TARGET
    # resumed and cancelled: aborted by their exact rids before the engines paused, tokens so far kept
    for res in (resumed, cancelled):
        assert res.finish_reason.type == "abort" and 0 < len(res.output_ids) < LONG
        assert all(s.version == 0 for s in res.weight_versions)
    assert young.cancelled == "" and "lag 3" in stale.cancelled and keep.cancelled == ""
    aborts = [body for _, path, _, body in proxy.requests if path == "/abort_request"]
    assert aborts and all(not b.get("abort_all") for b in aborts), aborts
    assert {b["rid"] for b in aborts} == {f"{prefix}young", f"{prefix}stale"}
    assert [body for _, path, _, body in proxy.requests if path == "/pause_generation"] == [{"mode": "in_place"}]
    assert not [p for _, p, _, _ in proxy.requests if p == "/flush_cache"], "in_place survivors: no flush"


async def test_a_resumed_agents_trajectory_holds_the_engines_tokens_versions_and_logprobs(tmp_path, nats_server):
    """Issue 51 item 6, through a real agent: the service's own agent is met mid-decode by a
    per-request sync and resumed (its turn young, no length history: the rest belongs to the new
    weights); the published trajectory holds, token for token, what the engine returned in each
    call — ids, log-probs, and the version of each call (0 before the sync, 1 after). The engine
    runs in timing mode with a fixed length (300 tokens), so the episode does not depend on what
    a model says."""
    from tests.rollout.test_service_episodes import fetch_all, model_segments

    points = tmp_path / "failpoints"
    points.mkdir()
    timing = ("--timing-mode", "--timing-decode-ms", "5", "--timing-length-median", "300", "--timing-length-sigma", "0")
    with start_engine(tmp_path, *ENGINE_ARGS, *timing, env={failpoints.ENV_DIR: str(points)}, name="engine") as engine:
        proxy = await RecordingProxy(engine.url).start()
        try:
            async with stack(tmp_path, nats_server.url, [proxy.url], "async_training.partial_rollout=true",
                             "async_training.staleness_threshold=0.5", "rollout.total_rollout_steps=1", "rollout.n=1",
                             "rollout.tools=[]", "rollout.response_length=400", "rollout.sampling.max_new_tokens=400",
                             "sync.pause_policy=per_request") as (svc, rollout_url, agent, agent_url, cfg):
                await wait_for(lambda: engine_tokens_over(engine, 40), WAIT_S, "the agent's turn to decode")
                (points / f"{STEP}.arm").touch()
                await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the turn")
                assert len(svc.runner.calls.calls) == 1
                pub = publisher(agent_url, cfg)
                try:
                    _, weights = perturbed_weights(4)
                    await sync_through_the_held_step(points, proxy, pub.publish(1, weights))
                    rec = agent.coordinator.records[-1]
                    await wait_for(lambda: rec.done, 60, "the sync to finish")
                    assert rec.state == "succeeded", rec.error
                finally:
                    await pub.close()
                assert (rec.pause_outcome.resumed, rec.pause_outcome.kept, rec.pause_outcome.cancelled) == (1, 0, 0)
                [traj] = await fetch_all(nats_server.url, cfg.run.id, 1)
        finally:
            await proxy.stop()
    calls = [(req, resp) for req, resp in proxy.exchanges if f".{traj.id}." in req["rid"]]
    assert len(calls) == 2 and calls[0][1]["meta_info"]["finish_reason"]["type"] == "abort", [r["rid"] for r, _ in calls]
    [(start, end)] = model_segments(traj)
    ids = [t[1] for _, resp in calls for t in resp["meta_info"]["output_token_logprobs"]]
    lps = [t[0] for _, resp in calls for t in resp["meta_info"]["output_token_logprobs"]]
    assert traj.response_ids[start:end] == ids and traj.rollout_logprobs[start:end] == lps
    first = len(calls[0][1]["output_ids"])
    assert 0 < first < len(ids) and len(ids) == 300
    assert traj.weight_versions[start:start + first] == [0] * first and traj.weight_versions[start + first:end] == [1] * (len(ids) - first)
    assert calls[1][0]["input_ids"] == traj.token_ids[: traj.prompt_length + first], "resent with the tokens kept"
