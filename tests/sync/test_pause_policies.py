"""``sync.pause_policy`` end to end: what a sync does with a generation in flight, seen from the
rollout service's engine pool, and the calls the sync makes (through a recording proxy in front
of the engine). The engine-side semantics of each mode (retract re-prefills with the new
weights, in_place keeps the KV) are pinned in tests/local_engine/test_pause.py."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl import failpoints
from asyncrl.sync_control.pause_policy import pause_plan
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.waiting import WAIT_S, wait_for
from tests.rollout.conftest import ADMIN
from tests.sync.conftest import (
    ENGINE_ARGS,
    SYNC_TOKEN,
    config,
    engine_tokens_over,
    perturbed_weights,
    publisher,
    service_idle,
    stack,
    sync_through_the_held_step,
)

PROMPT = [5, 17, 42, 99, 7, 300, 12]
LONG = 1500  # tokens: the generation's budget (it is held mid-way until the sync's pause reaches the engine)
STEP = "local_engine.step"
CALL_S = 180.0


def test_pause_plans():
    """The table of asyncrl.sync_control.pause_policy, and partial rollout off overriding it."""
    assert pause_plan("abort", True) == pause_plan("abort", True).__class__("abort", "partial", "abort", 30)
    assert (pause_plan("retract", True).rollout_mode, pause_plan("retract", True).engine_mode,
            pause_plan("retract", True).flush_retries) == ("hold", "retract", 1)
    assert (pause_plan("in_place", True).rollout_mode, pause_plan("in_place", True).engine_mode,
            pause_plan("in_place", True).flush_retries) == ("hold", "in_place", 0)
    per = [pause_plan("per_request", True, survivors) for survivors in ("in_place", "retract")]
    assert [(p.rollout_mode, p.engine_mode, p.flush_retries) for p in per] == [("per_request", "in_place", 0),
                                                                               ("per_request", "retract", 1)]
    for policy in ("abort", "retract", "in_place", "per_request"):
        off = pause_plan(policy, False)
        assert (off.rollout_mode, off.engine_mode) == ("drain", "abort")
    with pytest.raises(ValueError, match="unknown pause policy"):
        pause_plan("pause", True)
    with pytest.raises(ValueError, match="survivor mode"):
        pause_plan("per_request", True, "abort")


@pytest.mark.parametrize("policy", ["abort", "retract", "in_place"])
async def test_a_sync_treats_the_generation_in_flight_by_its_policy(tmp_path, nats_server, policy):
    """The generation is held mid-way at the engine (failpoint ``local_engine.step``) from when it
    has decoded a few tokens until the sync's pause reaches the engine, so the sync always meets
    it in flight, however fast or loaded the machine (it once finished first on a loaded box)."""
    points = tmp_path / "failpoints"
    points.mkdir()
    with start_engine(tmp_path, *ENGINE_ARGS, env={failpoints.ENV_DIR: str(points)}, name=f"engine-{policy}") as engine:
        proxy = await RecordingProxy(engine.url).start()
        try:
            async with stack(tmp_path, nats_server.url, [proxy.url], "async_training.partial_rollout=true",
                             "rollout.total_rollout_steps=1", "rollout.n=1",  # the service's own agents: one, then none
                             f"sync.pause_policy={policy}") as (svc, rollout_url, agent, agent_url, cfg):
                assert agent.coordinator.pause_mode == ("partial" if policy == "abort" else "hold")
                await wait_for(lambda: service_idle(svc, engine), WAIT_S, "the service's own sample to finish")
                rid = f"{svc.runner.rid_prefix}policy-{policy}"
                call = asyncio.create_task(svc.pool.generate(None, PROMPT, {"max_new_tokens": LONG, "temperature": 0.0,
                                                                            "ignore_eos": True}, rid))
                # decoding (not just queued): its first tokens come from the old weights whatever the policy
                await wait_for(lambda: engine_tokens_over(engine, len(PROMPT) + 10), WAIT_S, "the long generation to decode")
                (points / f"{STEP}.arm").touch()
                await wait_for(lambda: bool(failpoints.reached(points, STEP)), WAIT_S, "the engine to hold the generation")
                pub = publisher(agent_url, cfg, bucket_bytes=1 << 20)
                try:
                    _, weights = perturbed_weights(3)
                    await sync_through_the_held_step(points, proxy, pub.publish(1, weights))
                    rec = agent.coordinator.records[-1]
                    await wait_for(lambda: rec.done, 60, "the sync to finish")
                    assert rec.state == "succeeded", rec.error
                finally:
                    await pub.close()
                res = await asyncio.wait_for(call, CALL_S)
                assert not svc.runner.paused and svc.runner.version == 1
        finally:
            await proxy.stop()
    pauses = [body for method, path, _, body in proxy.requests if path == "/pause_generation"]
    flushes = [path for _, path, _, _ in proxy.requests if path == "/flush_cache"]
    assert pauses == [{"mode": policy}]
    spans = [(s.version, s.start, s.end) for s in res.weight_versions]
    if policy == "abort":
        # aborted by its exact rid: partial output, every token from the old weights; the
        # rollout's agent would resend prompt + these tokens (re-prefilled) after the sync
        assert res.finish_reason.type == "abort" and 0 < len(res.output_ids) < LONG and len(spans) <= 1
        assert flushes, "abort flushes the prefix cache"
        return
    # retract / in_place: never aborted, finished after the sync with the new weights' tail
    assert res.finish_reason.type == "length" and len(res.output_ids) == LONG
    assert len(spans) == 2 and spans[0][0] != 1 and spans[1][0] == 1 and spans[1][2] == LONG
    assert res.meta_info["num_retractions"] == (1 if policy == "retract" else 0)
    assert flushes == (["/flush_cache"] if policy == "retract" else []), "in_place never flushes; retract tries once"


async def test_a_policy_that_keeps_requests_is_refused_on_an_engine_without_spans(tmp_path, nats_server):
    """Issue 35 item 3: an engine emulating sglang 0.5.18 returns no weight_versions spans, so
    under ``retract`` the trainer could not tell the old weights' tokens from the new. One that
    joins the run after the agent started (added at the rollout service) makes the agent refuse
    the sync (409 ``pause_policy``, naming the engine and its release); every engine keeps
    serving its version."""
    from asyncrl.sync_control.errors import WeightSyncError
    from tests.helpers.processes import start_engine

    with start_engine(tmp_path, name="engine-0.5.23") as new, \
            start_engine(tmp_path, "--sglang-compat", "0.5.18", name="engine-0.5.18") as old:
        async with stack(tmp_path, nats_server.url, [new.url], "async_training.partial_rollout=true",
                         "sync.pause_policy=retract", f'engines.allowed_hosts=["127.0.0.1:{old.port}"]') \
                as (svc, rollout_url, agent, agent_url, cfg):
            old_id = svc.pool.add(old.url).id
            pub = publisher(agent_url, cfg)
            try:
                _, weights = perturbed_weights(1)
                with pytest.raises(WeightSyncError, match="409") as refused:
                    await pub.publish(1, weights)
                message = str(refused.value)
                assert "answered 409 pause_policy: " in message and f"engine {old_id} runs sglang 0.5.18" in message, message
                assert "pause_policy=retract" in message
                assert agent.coordinator.records == [] and not svc.runner.paused
            finally:
                await pub.close()


async def test_the_agent_refuses_to_start_with_a_policy_its_engines_cannot_run(tmp_path, nats_server):
    """Issue 35 item 3, at start: ``retract`` on a configured engine without spans stops the
    agent from starting (the process exits naming the engine and its release) instead of
    failing every sync later; ``abort`` on the same engine starts."""
    import subprocess
    import sys

    from tests.helpers.processes import start_engine

    with start_engine(tmp_path, "--sglang-compat", "0.5.18", name="engine-0.5.18") as engine:
        cfg = config(tmp_path, nats_server.url, [engine.url], "async_training.partial_rollout=true", "sync.pause_policy=retract")
        from sync_agent.agent import PolicyRefused, SyncAgent

        agent = SyncAgent(cfg)
        try:
            with pytest.raises(PolicyRefused, match=f"engine {engine.url} runs sglang 0.5.18"):
                await agent.start()
        finally:
            await agent.close()
        relaxed = config(tmp_path, nats_server.url, [engine.url], "async_training.partial_rollout=true", "sync.pause_policy=abort")
        assert await SyncAgent(relaxed).coordinator.problems_at_start() == []
        # the real process: it exits, saying why
        argv = [sys.executable, "-m", "sync_agent", f"run.dir={tmp_path / 'run'}", f"engines.urls=[\"{engine.url}\"]",
                f"security.sync_token={SYNC_TOKEN}", f"security.admin_token={ADMIN}", "async_training.partial_rollout=true",
                "sync.pause_policy=retract", "sync.port=0"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "runs sglang 0.5.18" in proc.stdout + proc.stderr, (proc.returncode, proc.stderr[-2000:])


async def test_in_place_is_refused_on_engines_that_cache_prefixes_or_overlap_their_steps(tmp_path, nats_server):
    """Issue 66 N1, N2: an engine on SGLang's defaults keeps old-weight KV in its prefix cache
    across an in_place sync (a resent call decodes over it) and labels each kept request's pending
    old-weight token with the new version (tests/local_engine/test_sync_hazards.py shows both).
    The agent refuses ``in_place`` and per_request's in_place survivors there, naming each flag,
    at start and at a sync (409 ``pause_policy``, for an engine that joins later); the same
    engine passes for ``abort``, ``retract`` and per_request with retract survivors, and an
    engine with both flags passes for every policy."""
    from asyncrl.sync_control.errors import WeightSyncError
    from sync_agent.agent import SyncAgent
    from tests.helpers.processes import start_engine
    from tests.sync.conftest import IN_PLACE_SAFE

    with start_engine(tmp_path, name="engine-defaults") as plain, start_engine(tmp_path, *IN_PLACE_SAFE, name="engine-safe") as safe:
        async def problems(url: str, *overrides: str) -> list[str]:
            cfg = config(tmp_path, nats_server.url, [url], "async_training.partial_rollout=true", *overrides)
            return await SyncAgent(cfg).coordinator.problems_at_start()

        for policy, which in ((("sync.pause_policy=in_place",), "sync.pause_policy=in_place"),
                              (("sync.pause_policy=per_request",), "per_request's in_place survivors")):
            found = await problems(plain.url, *policy)
            assert len(found) == 2 and all(f"engine {plain.url} runs without" in p and which in p for p in found), found
            assert "--disable-radix-cache" in found[0] and "--disable-overlap-schedule" in found[1], found
            assert await problems(safe.url, *policy) == []
        for relaxed in (("sync.pause_policy=abort",), ("sync.pause_policy=retract",),
                        ("sync.pause_policy=per_request", "sync.per_request.survivor_mode=retract")):
            assert await problems(plain.url, *relaxed) == [], relaxed
        async with stack(tmp_path, nats_server.url, [safe.url], "async_training.partial_rollout=true",
                         "sync.pause_policy=in_place", f'engines.allowed_hosts=["127.0.0.1:{plain.port}"]') \
                as (svc, rollout_url, agent, agent_url, cfg):
            plain_id = svc.pool.add(plain.url).id
            pub = publisher(agent_url, cfg)
            try:
                _, weights = perturbed_weights(1)
                with pytest.raises(WeightSyncError, match="409") as refused:
                    await pub.publish(1, weights)
                message = str(refused.value)
                assert "answered 409 pause_policy: " in message and f"engine {plain_id} runs without --disable-radix-cache" in message
                assert "--disable-overlap-schedule" in message and f"engine {safe.url}" not in message, message
                assert agent.coordinator.records == [] and not svc.runner.paused
            finally:
                await pub.close()
