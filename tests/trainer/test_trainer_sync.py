"""Weight sync from a torchrun trainer to a real local_engine, both publishers; plus what the
same runs show about the consumer: stale trajectories dropped and counted, poison messages
terminated, counted and dead-lettered while training goes on.

Direct run (``DirectEnginePublisher``), one group per step, sync after every step,
``staleness_threshold=0``: the stream starts with group A (version 0) and two poison messages;
after the trainer reports weight version 1, group B (version 0: now too stale) and group C
(version 1) follow. Expected: A and C trained, B dropped, two dead letters, engine at version 2
serving exactly the trainer's final weights. Its weights go through ``sync.staging=two_buckets``
(streamed through two reused buffers while the engine loads them); the agent run's are packed at
the sync point (``buckets``); the loop tests use the host path (``state_dict``).

Agent run (``SyncAgentPublisher`` + ``fake_sync_agent``, weights staged as packed buckets at
the sync point: ``sync.staging=buckets``, the GPU path's code on gloo): three syncs; the agent fails the
first at once (engines never join: the trainer's watcher sees the failure and stops hosting
the group — a failed sync, counted, training goes on), forms the group on the second, reuses
it on the third.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from asyncrl.config import load_config
from asyncrl.engine_client import EngineClient
from asyncrl.models import load_model
from asyncrl.wire import SCHEMA_TAG, NatsNames
from asyncrl.wire.sync import SyncRequest
from tests.helpers.processes import start_engine
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import wait_for_sync
from tests.trainer.fake_sync_agent import FakeSyncAgent
from tests.trainer.helpers import (
    NOT_YET,
    latest_export,
    listening_sockets,
    make_group,
    metrics_lines,
    publish,
    publish_raw,
    read_subject,
    scrape,
    start_trainer,
    wait_exit,
)
from trainer_daemon.audit import audit_run
from trainer_daemon.rank0 import metrics_endpoint
from trainer_daemon.state.checkpoint import read_state
from trainer_daemon.state.ledger import read_lineage

DISK_VERSION = 900  # the label the HF export is loaded under (far above the syncs' versions)

N = 2
READY_S = 180.0
SYNC_S = 120.0
TOKEN = "sync-token-for-tests-0123456789"
POISON = [(b"\x00\xffnot msgpack at all", "poison-1"),
          (b"\x81\xa6schema\xb4asyncrl.trajectory/9", "poison-2")]  # {"schema": "asyncrl.trajectory/9"}
PROMPTS = [[400 + i, 500 + i, 600 + i, 700 + i] for i in range(3)]
TOL = 1e-5


def base_overrides(run_dir, nats_url, run_id):
    return [f"run.dir={run_dir}", f"nats.url={nats_url}", f"run.id={run_id}", f"rollout.n={N}",
            "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=2", "trainer.metrics_port=0",
            "actor.optim.lr=1e-3", "async_training.trigger_parameter_sync_step=1", "sync.group_init_timeout_s=60",
            "sync.broadcast_timeout_s=60", "sync.pause_timeout_s=30", "sync.resume_timeout_s=30",
            # the module's runs share one NATS server, which refuses a stream once the streams' byte
            # limits add up to more than its store may take (75 % of the free disk at its start):
            # five runs at the default 4 GiB failed on a CI disk with 21 GB free
            "nats.stream_max_bytes=268435456"]


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    with start_engine(tmp_path_factory.mktemp("engine-logs")) as engine:
        yield engine.url


async def _engine_view(url: str) -> dict:
    async with EngineClient(url, control_timeout_s=60, request_timeout_s=60) as c:
        out = {"version": await c.weight_version(), "samples": []}
        for prompt in PROMPTS:
            res = await c.generate(prompt, {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
            out["samples"].append((prompt, res.output_ids, res.logprobs))
        return out


def engine_view(url: str) -> dict:
    return asyncio.run(_engine_view(url))


def max_logprob_gap(model, samples) -> float:
    return max(abs(a - b) for prompt, ids, lps in samples for a, b in zip(lps, teacher_forced_logprobs(model, prompt, ids), strict=True))


@pytest.fixture(scope="module")
def direct_run(module_nats, engine_url, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("direct") / "run"
    overrides = [*base_overrides(run_dir, module_nats.url, "direct"), f"engines.urls=[\"{engine_url}\"]",
                 "trainer.total_training_steps=2", "async_training.staleness_threshold=0",
                 "sync.staging=two_buckets", "sync.bucket_bytes=1048576"]  # streamed through two buffers, several buckets
    cfg = load_config(overrides=overrides, environ={})
    rng = random.Random(1)
    a, b, c = make_group(rng, "a", N, 0), make_group(rng, "b", N, 0), make_group(rng, "c", N, 1)
    publish(cfg, a)
    publish_raw(cfg, POISON)
    proc = start_trainer(run_dir, overrides)
    out = {"run_dir": run_dir, "ids": {"a": [t.id for t in a], "b": [t.id for t in b], "c": [t.id for t in c]}}
    try:
        url = wait_for_sync(lambda: metrics_endpoint(run_dir), READY_S, "metrics endpoint", procs=[proc], retry_on=NOT_YET)
        wait_for_sync(lambda: scrape(url).get("asyncrl_trainer_weight_version") == 1, SYNC_S, "weight version 1", procs=[proc], retry_on=NOT_YET)
        out["listeners"] = listening_sockets(proc.pid)
        publish(cfg, b + c)
        out["exit"] = wait_exit(proc)
    finally:
        proc.stop()
    out["engine"] = engine_view(engine_url)
    out["lines"] = metrics_lines(run_dir)
    out["dlq"] = read_subject(cfg, NatsNames("direct").dead_letters)
    out["log"] = (run_dir / "logs" / "trainer.log").read_text()
    return out


def test_direct_sync_engine_serves_the_trainers_weights(direct_run):
    assert direct_run["exit"] == 0
    view = direct_run["engine"]
    assert view["version"] == 2
    trained = load_model(str(latest_export(direct_run["run_dir"])))
    assert max_logprob_gap(trained, view["samples"]) < TOL
    assert max_logprob_gap(load_model("builtin:tiny", seed=0), view["samples"]) > 1e-3  # the weights did change


def test_stale_trajectories_are_dropped_and_counted(direct_run):
    last = direct_run["lines"][-1]
    assert last["trainer/dropped_stale_trajectories"] == N and last["trainer/trained_trajectories"] == 2 * N
    entries = read_lineage(direct_run["run_dir"] / "checkpoints", 2)
    ids = direct_run["ids"]
    assert sorted(i for e in entries for i in e["trained"]) == sorted(ids["a"] + ids["c"])
    assert sorted(i for e in entries for i in e.get("dropped", [])) == sorted(ids["b"])


def test_poison_is_terminated_counted_and_dead_lettered(direct_run):
    assert direct_run["lines"][0]["trainer/poison_messages"] == 2 and len(direct_run["lines"]) == 2
    dlq = direct_run["dlq"]
    assert sorted(m.data for m in dlq) == sorted(p for p, _ in POISON)
    reasons = " ".join(m.headers["Asyncrl-Reason"] for m in dlq)
    assert "not a trajectory message" in reasons and "asyncrl.trajectory/9" in reasons and SCHEMA_TAG in reasons
    assert "poison message at stream sequence" in direct_run["log"]


def test_audit_reconciles_the_stream_with_the_ledger(direct_run, module_nats):
    audit = asyncio.run(audit_run(direct_run["run_dir"], module_nats.url, "direct"))
    assert audit.ok and (audit.lost, audit.twice, audit.pending) == (0, 0, 0), audit
    assert (audit.trained, audit.dropped, audit.poison, audit.dlq, audit.published) == (2 * N, N, 2, 2, 3 * N + 2), audit


def test_weight_group_store_listens_on_loopback(direct_run):
    line = next(x for x in direct_run["log"].splitlines() if "hosting weight group" in x)
    port = int(line.rsplit(":", 1)[1])
    listeners = direct_run["listeners"]
    assert port in {p for _, p, _ in listeners}, (port, listeners)
    assert all(ip == "127.0.0.1" for ip, _, _ in listeners), listeners


@pytest.fixture(scope="module")
def agent_run(module_nats, engine_url, tmp_path_factory, direct_run):
    run_dir = tmp_path_factory.mktemp("agent") / "run"
    with FakeSyncAgent([engine_url], TOKEN) as agent:
        agent.ignore_next = 1
        overrides = [*base_overrides(run_dir, module_nats.url, "agent"), f"engines.urls=[\"{engine_url}\"]",
                     f"sync.url={agent.url}", f"security.sync_token={TOKEN}", "trainer.total_training_steps=3",
                     "async_training.staleness_threshold=2", "sync.group_init_timeout_s=5", "sync.pause_timeout_s=1",
                     "sync.staging=buckets"]  # the device path (packed at the sync point), on gloo
        cfg = load_config(overrides=overrides, environ={})
        rng = random.Random(2)
        publish(cfg, [t for g in range(3) for t in make_group(rng, f"s{g}", N, 0)])
        proc = start_trainer(run_dir, overrides, name="trainer-agent")
        try:
            code = wait_exit(proc)
        finally:
            proc.stop()
        wait_for_sync(lambda: all(s.state in ("succeeded", "failed") for s in list(agent.syncs.values())), 30, "agent syncs settled")
        return {"exit": code, "run_dir": run_dir, "bodies": list(agent.bodies), "syncs": dict(agent.syncs),
                "engine": engine_view(engine_url), "lines": metrics_lines(run_dir)}


def test_agent_sync_engine_serves_the_trainers_weights(agent_run):
    assert agent_run["exit"] == 0
    view = agent_run["engine"]
    assert view["version"] == 2  # one failed sync, then versions 1 and 2
    trained = load_model(str(latest_export(agent_run["run_dir"])))
    assert max_logprob_gap(trained, view["samples"]) < TOL


def test_agent_protocol_bodies(agent_run):
    bodies = [SyncRequest.model_validate(b) for b in agent_run["bodies"]]  # the one typed message
    assert [b.version for b in bodies] == [1, 1, 2]
    assert [b.group.new for b in bodies] == [True, True, False]
    assert bodies[0].group.key != bodies[1].group.key == bodies[2].group.key  # re-formed after the failure, then reused
    # every group formed has a name of its own (a name still held after a failed destroy would refuse the next)
    names = [b.group.group_name for b in bodies]
    assert names[0] != names[1] == names[2] and all(n.startswith("weight_update_group-") for n in names)
    assert all(b.group.backend == "gloo" and b.group.torch_version for b in bodies)
    model = load_model("builtin:tiny", seed=0)
    expected = [n for n in model.state_dict() if n != "lm_head.weight"]
    smallest = min(expected, key=lambda n: model.state_dict()[n].numel())
    for b in bodies:  # staged buckets (sync.staging=buckets): the smallest tensor first, alone, every time
        names = [n for bucket in b.buckets for n in bucket.names]
        assert b.buckets[0].names == [smallest] and names[1:] == [n for n in expected if n != smallest]


def test_failed_sync_is_counted_and_training_continues(agent_run):
    states = sorted(s.state for s in agent_run["syncs"].values())
    assert states == ["failed", "succeeded", "succeeded"]
    assert [line["step"] for line in agent_run["lines"]] == [1, 2, 3]
    assert max(line.get("trainer/sync_failures", 0) for line in agent_run["lines"]) == 1
    state = read_state(latest_export(agent_run["run_dir"]).parent)
    assert state["weight_version"] == 2


def test_export_loads_into_an_engine_from_disk(direct_run, agent_run, engine_url):
    """The HF export is what ``/update_weights_from_disk`` takes (runs last: it rewrites the engine)."""
    export = latest_export(direct_run["run_dir"])

    async def load() -> None:
        async with EngineClient(engine_url, control_timeout_s=120) as c:
            await c.update_weights_from_disk(str(export), weight_version=DISK_VERSION)

    asyncio.run(load())
    view = engine_view(engine_url)
    assert view["version"] == DISK_VERSION
    assert max_logprob_gap(load_model(str(export)), view["samples"]) < TOL


def test_an_idle_trainer_publishes_when_the_agent_asks_for_a_push(module_nats, engine_url, tmp_path, agent_run):
    """Every engine out (quarantined, nothing to reload from): no data comes, so the trainer
    would never reach a sync point. It publishes from idle when the agent says so (runs after
    the agent run: it rewrites the engine)."""
    run_dir = tmp_path / "push" / "run"
    with FakeSyncAgent([engine_url], TOKEN) as agent:
        overrides = [*base_overrides(run_dir, module_nats.url, "push"), f"sync.url={agent.url}",
                     f"security.sync_token={TOKEN}", "trainer.total_training_steps=1"]
        proc = start_trainer(run_dir, overrides, name="trainer-push")
        try:
            wait_for_sync(lambda: metrics_endpoint(run_dir), READY_S, "the trainer to start", procs=[proc])
            assert agent.bodies == [], "nothing to publish while no step ran and nobody asked"
            agent.push_wanted = True
            wait_for_sync(lambda: any(s.state == "succeeded" for s in agent.syncs.values()), SYNC_S,
                          "a sync pushed from idle", procs=[proc])
            assert [b["version"] for b in agent.bodies] == [1] and agent.version == 1  # the fresh trainer's weights
            assert not metrics_lines(run_dir), "no training step happened"
        finally:
            proc.stop()


def test_a_lora_trainer_syncs_the_merged_weights(module_nats, engine_url, tmp_path, agent_run):
    """``actor.lora_rank``: the engine (no adapter support needed) serves base + B @ A * alpha/r,
    the model the export's ``model.safetensors`` holds (runs last: it rewrites the engine)."""
    run_dir = tmp_path / "lora" / "run"
    overrides = [*base_overrides(run_dir, module_nats.url, "lora"), f"engines.urls=[\"{engine_url}\"]",
                 "trainer.total_training_steps=1", "actor.lora_rank=4", "actor.lora_alpha=8", "actor.optim.lr=0.05",
                 "sync.lora_weights=merged"]
    cfg = load_config(overrides=overrides, environ={})
    publish(cfg, make_group(random.Random(9), "l", N, 0, run_id="lora"))
    proc = start_trainer(run_dir, overrides, name="trainer-lora")
    try:
        assert wait_exit(proc) == 0
    finally:
        proc.stop()
    view = engine_view(engine_url)
    export = latest_export(run_dir)
    state = json.loads((export.parent / "trainer_state.json").read_text())
    assert view["version"] == state["weight_version"]  # (above what the earlier tests left on the engine)
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    assert max_logprob_gap(load_model(str(export)), view["samples"]) < TOL
    assert max_logprob_gap(load_model("builtin:tiny", seed=0), view["samples"]) > 1e-3  # the adapters did move it
