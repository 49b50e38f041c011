"""``sync.pause_policy = "per_request"`` on SGLang's own scheduler (issue 51): the sequence of
tests/sync/test_per_request_pause.py run against local_engine (``--sglang-compat 0.5.23``) and a
real SGLang 0.5.23 server. Three calls in flight (driven agent states, so each outcome is
certain) are held with ``/slow_down`` until the sync's ``/pause_generation`` reaches the engine:
the nearly finished one is kept (the engine pauses ``in_place`` and finishes it on the new
weights, two version spans), the young one is aborted by its exact rid, the one the trainer would
drop for staleness is cancelled — on SGLang as on local_engine, with exact aborts only. The
engines run without prefix cache and overlap scheduler, as the agent requires for in_place
survivors; the young call's resend after the sync is then prefilled whole by the new weights
(``cached_tokens`` 0, its log-probs the new weights' over its whole context: issue 66 W1)."""

from __future__ import annotations

import asyncio

import pytest

from rollout_service.runner.inflight import TurnLengths
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import WAIT_S, wait_for
from tests.sglang.conftest import ADMIN_KEY, API_KEY, DEMO_MODEL
from tests.sglang.test_sync_policies import (
    CALL_S,
    CLOSE,
    SLOW_S,
    demo_models,
    one_engine,
    slow_down,
    tokens_in_flight,
)
from tests.sync.conftest import IN_PLACE_SAFE, perturbed_weights, publisher, stack
from tests.sync.test_per_request_pause import PROMPT, driven

LONG = 300  # each call's budget: three of them fit the servers' 1024-token context and 8192-token pool
TARGET = 3  # version 0 lags 3 > ceil(0.5) + 1 = 2 at the sync: the trainer would drop it


@pytest.mark.parametrize("kind", ["local", "sglang"])
async def test_a_per_request_sync_keeps_resumes_and_cancels(tmp_path, nats_server, kind):
    with one_engine(kind, "0.5.23", tmp_path, *IN_PLACE_SAFE) as engine:  # in_place survivors need both (issue 66)
        proxy = await RecordingProxy(engine.url).start()
        extra = ("async_training.partial_rollout=true", "async_training.staleness_threshold=0.5", "rollout.total_rollout_steps=1",
                 "rollout.n=1", "sync.pause_policy=per_request", f"model.path={DEMO_MODEL}", f"engines.api_key={API_KEY}",
                 f"engines.admin_api_key={ADMIN_KEY}")
        try:
            async with stack(tmp_path, nats_server.url, [proxy.url], *extra) as (svc, _url, agent, agent_url, cfg):
                await wait_for(lambda: svc.runner.snapshot().active == 0 and svc.runner.counters.trajectories_finished >= 1,
                               CALL_S, "the service's own sample to finish")
                await slow_down(engine, SLOW_S)
                prefix = svc.runner.rid_prefix
                keep, young, stale = driven("keep", 2, 2 * LONG), driven("young", 2, 0), driven("stale", 0, 20)
                svc.runner.agents[stale.id] = stale  # the runner's own agent (a session's call is never cancelled)
                svc.runner.calls.turns, svc.runner.calls.decode_rate = TurnLengths(), None  # progress against the budget, no
                # estimate of tokens in flight, nothing projected: the driven facts alone decide
                generator = svc.runner.calls.routed(svc.pool)
                params = {"max_new_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
                calls = {s.id: asyncio.create_task(generator.generate(s, PROMPT, params, f"{prefix}{s.id}"))
                         for s in (keep, young, stale)}
                await wait_for(lambda: _over(engine, 3 * len(PROMPT) + 6), WAIT_S * 4, "all three to decode")
                pub = publisher(agent_url, cfg, bucket_bytes=1 << 20)
                try:
                    _, weights = perturbed_weights(3)
                    sync = asyncio.create_task(pub.publish(TARGET, weights))
                    await wait_for(lambda: any(p == "/pause_generation" for _, p, _, _ in proxy.requests) or sync.done(),
                                   CALL_S, "the sync's pause to reach the engine")
                    await slow_down(engine, None)
                    await sync
                    rec = agent.coordinator.records[-1]
                    await wait_for(lambda: rec.done, 60, "the sync to finish")
                    assert rec.state == "succeeded", rec.error
                finally:
                    await pub.close()
                results = {k: await asyncio.wait_for(t, CALL_S) for k, t in calls.items()}
                assert not svc.runner.paused and svc.runner.version == TARGET
                assert svc.runner.counters.per_request_calls == {"kept": 1, "resumed": 1, "cancelled": 1, "missed": 0}
                # the resumed call's resend (prompt + its kept tokens, what its agent sends after the sync):
                # prefilled whole by the new weights, nothing taken from the aborted call's KV (issue 66 W1)
                context = PROMPT + results["young"].output_ids
                resent = await svc.pool.generate(None, context, {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True},
                                                 f"{prefix}young-resent")
        finally:
            await slow_down(engine, None)
            await proxy.stop()
    assert resent.cached_tokens == 0, "the resend reused KV the old weights computed"
    assert [s.version for s in resent.weight_versions] == [TARGET]
    new = demo_models(perturbed_weights(3)[1])
    gaps = [abs(a - b) for a, b in zip(resent.logprobs, teacher_forced_logprobs(new, context, resent.output_ids), strict=True)]
    assert max(gaps) < CLOSE, f"the resumed call's tokens are not the new weights' over its whole context: {gaps[:4]}"
    spans = [(s.version, s.start, s.end) for s in results["keep"].weight_versions]
    assert results["keep"].finish_reason.type == "length" and len(results["keep"].output_ids) == LONG
    assert len(spans) == 2 and spans[0][0] != TARGET and spans[1][0] == TARGET and spans[1][2] == LONG, spans
    for rid in ("young", "stale"):
        res = results[rid]
        assert res.finish_reason.type == "abort" and 0 < len(res.output_ids) < LONG, (rid, res.finish_reason)
    assert "lag 3" in stale.cancelled and not young.cancelled
    aborts = [body for _, path, _, body in proxy.requests if path == "/abort_request"]
    assert aborts and all(not b.get("abort_all") for b in aborts), aborts
    assert {b["rid"] for b in aborts} == {f"{prefix}young", f"{prefix}stale"}
    assert [body for _, path, _, body in proxy.requests if path == "/pause_generation"] == [{"mode": "in_place"}]


async def _over(engine, n: int) -> bool:
    return await tokens_in_flight(engine) > n
