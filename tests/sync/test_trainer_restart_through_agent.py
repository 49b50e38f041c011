"""F17 through a running sync agent: a trainer SIGKILLed after the engines got a version its
checkpoint lacks, restarted while it cannot ask the agent what the engines serve.

The restarted trainer republishes its restored weights under the checkpoint's version; the
agent refuses it with 409 ``stale`` and names the engines' version; the trainer adopts it
(``SyncController.adopt``: its weights become that version + 1, the lost steps are not counted
as progress) and its next sync goes through. Exactly one sync is refused, versions stay
monotonic, the engine ends on exactly the trainer's final weights and the run is healthy.
(tests/trainer/test_trainer_restart_versions.py covers the same restart with the engines'
version known at start, driving the engine directly.)
"""

from __future__ import annotations

import asyncio
import random
import signal

import httpx

from asyncrl.models import load_model
from sync_agent.history import SyncHistory
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.run_health import wait_run_healthy
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN
from tests.sync.conftest import ENGINE_ARGS, SYNC_TOKEN, stack
from tests.sync.test_sync_agent import engine_logprobs, model_logprobs
from tests.trainer.helpers import (
    NOT_YET,
    latest_export,
    make_group,
    publish,
    start_trainer,
    wait_exit,
)
from trainer_daemon.state.checkpoint import complete_checkpoints, read_state

N = 2
STEP_S = 240.0  # a trainer start (torch + transformers import) on a busy 2-core box
AUTH = {"Authorization": f"Bearer {SYNC_TOKEN}"}


async def agent_syncs(agent_url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{agent_url}/v1/syncs", headers=AUTH)).json()["syncs"]


async def agent_version(agent_url: str) -> int | None:
    async with httpx.AsyncClient(timeout=10) as http:
        return (await http.get(f"{agent_url}/status", headers=AUTH)).json()["version"]


async def test_restarted_trainer_adopts_the_agents_version_after_one_stale_refusal(tmp_path, nats_server):
    engine = start_engine(tmp_path / "engine", *ENGINE_ARGS)
    run_dir = tmp_path / "trainer-run"
    try:
        async with stack(tmp_path, nats_server.url, [engine.url]) as (svc, rollout_url, agent, agent_url, _cfg):
            proxy = await RecordingProxy(agent_url).start()
            first_status = []

            def refuse_first_status(method, path, _body):  # the agent unreachable at the trainer's start
                if method == "GET" and path == "/status" and not first_status:
                    first_status.append(True)
                    return 503, {"error": {"message": "restarting"}}
                return None

            base = [f"run.dir={run_dir}", f"nats.url={nats_server.url}", "run.id=f17-agent", f"rollout.n={N}",
                    "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2", "trainer.metrics_port=0",
                    "actor.optim.lr=1e-3", "async_training.trigger_parameter_sync_step=1", "trainer.checkpoint.save_freq=2",
                    f"sync.url={proxy.url}", f"security.sync_token={SYNC_TOKEN}", "sync.group_init_timeout_s=60",
                    "sync.broadcast_timeout_s=60", "async_training.staleness_threshold=100"]
            from asyncrl.config import load_config

            cfg = load_config(overrides=base, environ={})
            rng = random.Random(17)
            try:
                # phase 1: three steps, a sync after each, a checkpoint at step 2; killed at version 3
                await asyncio.to_thread(publish, cfg, [t for g in range(3) for t in make_group(rng, f"p{g}", N, 0)])
                proc = start_trainer(run_dir, [*base, "trainer.total_training_steps=10"], name="trainer-1")
                try:
                    await wait_for(lambda: _is(agent_version(agent_url), 3), STEP_S, "the engine at version 3", procs=[proc])
                    await wait_for(lambda: complete_checkpoints(run_dir / "checkpoints"), 60, "the step-2 checkpoint",
                                   procs=[proc], retry_on=NOT_YET)
                finally:
                    proc.signal(signal.SIGKILL)
                    proc.stop()
                [(step, path)] = complete_checkpoints(run_dir / "checkpoints")
                assert step == 2 and read_state(path)["weights_version"] == 2
                before = len(await agent_syncs(agent_url))

                # phase 2: restarted; its question "which version do the engines serve?" goes unanswered
                proxy.intercept = refuse_first_status
                proc = start_trainer(run_dir, [*base, "trainer.total_training_steps=4", "trainer.checkpoint.resume=true"],
                                     name="trainer-2")
                try:
                    await asyncio.to_thread(publish, cfg, [t for g in range(2) for t in make_group(rng, f"q{g}", N, 3)])
                    assert await asyncio.to_thread(wait_exit, proc) == 0, proc.failure("failed")
                finally:
                    proc.stop()
                assert first_status, "the trainer never asked the agent for the engines' version"
                syncs = (await agent_syncs(agent_url))[before:]
                refused = [s for s in syncs if s["state"] != "succeeded"]
                assert len(refused) == 0, refused  # a 409 is an answer to a request, never a sync record
                versions = [s["version"] for s in syncs]
                assert versions == sorted(versions) and versions and versions[0] > 3, versions
                assert versions[-1] == await agent_version(agent_url)
                # the agent's history on disk keeps the refusal beside the syncs
                history = SyncHistory(tmp_path / "run" / "sync", 2**20).read()
                assert [(e["code"], e["version"]) for e in history if e["event"] == "refused"] == [("stale", 2)]
                assert [e["version"] for e in history if e["event"] == "finished"][-len(versions):] == versions
                log = (run_dir / "logs" / "trainer-2.log").read_text()
                assert log.count("409 stale") == 1 and "the engines serve weight version 3, ahead of this trainer's" in log
                ids, lps, wv = await engine_logprobs(engine.url)
                assert wv == versions[-1]
                final = load_model(str(latest_export(run_dir)))
                assert max(abs(a - b) for a, b in zip(lps, model_logprobs(final, ids))) < 1e-4, "the trainer's final weights"
                rollout, _ = await wait_run_healthy(rollout_url, ADMIN, 60, agent_url, SYNC_TOKEN)
                assert rollout["version"] == versions[-1]
            finally:
                await proxy.stop()
    finally:
        engine.stop()


async def _is(value, expected) -> bool:
    return (await value) == expected
