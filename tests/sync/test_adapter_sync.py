"""Adapter syncs through the real sync agent (issue 36): the rollout service, NATS, engines on
loopback, and the trainer's side (``SyncAgentPublisher`` with an ``AdapterSnapshot``).

One engine serves LoRA (``--enable-lora``), the other does not (added to the rollout service
after the agent started: at start the agent refuses such an engine). A sync loads the adapter on the
first under ``<run id>-v<version>`` and sets its version; the second cannot load it, keeps
serving what it served and is held out of routing (the sync still succeeds: an adapter loads
whole or not at all, so nothing is mixed). Each later sync unloads the adapters older than the
version the rollout served until then. At start, an agent whose configured engines cannot serve
the run's adapter refuses to start, naming the setting.
"""

from __future__ import annotations

import signal

import httpx
import pytest

from asyncrl.engine_client import EngineClient
from local_engine.lora import read_adapter_dir
from tests.helpers.lora import make_adapter
from tests.helpers.processes import start_engine
from tests.helpers.reference_model import load_reference_model, teacher_forced_logprobs
from tests.helpers.waiting import wait_for
from tests.rollout.conftest import ADMIN
from tests.sync.conftest import ENGINE_ARGS, SYNC_TOKEN, config, stack
from trainer_daemon.sync.adapter import AdapterSnapshot

RUN_ID = "adapters"
LORA = ("actor.lora_rank=4", "actor.lora_alpha=8", "actor.target_modules=[\"q_proj\",\"v_proj\"]", f"run.id={RUN_ID}")
PROMPT = [5, 17, 42, 99, 7, 300, 12]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def lora_and_plain(tmp_path):
    started = []
    try:
        started.append(start_engine(tmp_path, *ENGINE_ARGS, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules",
                                    "q_proj", "v_proj", name="lora-engine"))
        started.append(start_engine(tmp_path, *ENGINE_ARGS, name="plain-engine"))
        yield started
    finally:
        for engine in started:
            engine.proc.signal(signal.SIGTERM)
        for engine in started:
            engine.stop()


def snapshots(tmp_path, n: int) -> list[tuple[object, AdapterSnapshot]]:
    """``n`` different peft adapters on the engines' model, as the trainer snapshots them."""
    base, out = load_reference_model(), []
    for i in range(n):
        model = make_adapter(base, tmp_path / f"adapter-{i}", seed=10 + i)
        config, tensors = read_adapter_dir(str(tmp_path / f"adapter-{i}"))
        out.append((model, AdapterSnapshot(tensors, config)))
    return out


async def _push_wanted(agent) -> bool:
    return agent.coordinator.push_wanted(await agent.coordinator.engine_views())


def adapter_publisher(agent_url: str, cfg, tmp_path):
    from trainer_daemon.sync.agent import SyncAgentPublisher

    s = cfg.sync
    return SyncAgentPublisher(agent_url, SYNC_TOKEN, master_address="127.0.0.1", bucket_bytes=1 << 20,
                              group_timeout_s=s.group_init_timeout_s, pause_timeout_s=s.pause_timeout_s,
                              broadcast_timeout_s=s.broadcast_timeout_s,
                              adapters={"run_id": RUN_ID, "transport": "auto", "adapter_dir": tmp_path / "adapters"})


@pytest.fixture
def restart_lora_engine(tmp_path):
    """``restart_lora_engine(port, name)``: a LoRA engine of ``lora_and_plain``'s kind started on
    ``port`` (tests/sglang/conftest.py gives a real SGLang one)."""
    return lambda port, name: start_engine(tmp_path, *ENGINE_ARGS, "--enable-lora", "--max-lora-rank", "8",
                                           "--lora-target-modules", "q_proj", "v_proj", port=port, name=name)


async def test_adapters_load_where_lora_is_served_and_the_rest_is_held_out(tmp_path, nats_server, lora_and_plain,
                                                                            restart_lora_engine):
    lora, plain = lora_and_plain
    versions = snapshots(tmp_path, 3)
    allow = f'engines.allowed_hosts=["127.0.0.1:{plain.port}"]'  # the one engine the operator adds (issue 67 L2)
    async with stack(tmp_path, nats_server.url, [lora.url], *LORA, allow) as (svc, rollout_url, agent, agent_url, cfg):
        async with httpx.AsyncClient() as http:  # joins after the start check (which would refuse it), as an operator adds one
            r = await http.post(f"{rollout_url}/admin/engines", json={"url": plain.url}, headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200, r.text
        pub = adapter_publisher(agent_url, cfg, tmp_path)
        try:
            metrics = await pub.publish(1, versions[0][1])
            assert metrics["trainer/sync_bytes"] == versions[0][1].nbytes and metrics["trainer/sync_buckets"] == 0
            status = {e.id: e for e in (await agent.rollout.status()).engines}
            ids = {e.url: e.id for e in status.values()}
            assert status[ids[plain.url]].state == "quarantined"
            assert "did not load the adapter of version 1" in status[ids[plain.url]].reason
            assert "--enable-lora" in status[ids[plain.url]].reason
            assert status[ids[lora.url]].state == "healthy"
            async with EngineClient(lora.url) as c:
                assert await c.weight_version() == 1 and await c.lora_adapters() == [f"{RUN_ID}-v1"]
                res = await c.generate(PROMPT, GREEDY, extra={"lora_path": f"{RUN_ID}-v1"})
                assert res.logprobs == pytest.approx(teacher_forced_logprobs(versions[0][0], PROMPT, res.output_ids), abs=1e-4)
            async with EngineClient(plain.url) as c:
                assert await c.weight_version() == 0  # "default"
            # the rollout asks for the current adapter and labels tokens with its version
            assert svc.pool.serving.adapter_route == (f"{RUN_ID}-v1", 1)
            out = await svc.pool.generate(None, PROMPT, GREEDY, rid="adapter-route-1")
            assert out.token_versions() == [1] * GREEDY["max_new_tokens"] and out.output_ids == res.output_ids
            for v in (2, 3):
                await pub.publish(v, versions[v - 1][1])
            async with EngineClient(lora.url) as c:  # v1 went at the start of sync 3 (v2 was current then)
                assert await c.weight_version() == 3
                assert sorted(await c.lora_adapters()) == [f"{RUN_ID}-v2", f"{RUN_ID}-v3"]
            assert agent.coordinator.version == 3 and not agent.coordinator.adapters  # payloads dropped after each sync
            assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [f"{RUN_ID}-v{v}" for v in (1, 2, 3)]
            await wait_for(lambda: svc.runner.version == 3, 30, "the rollout to resume at version 3")
            # repair: the plain engine comes back with LoRA on (same URL); the agent asks the
            # trainer for a push while it waits, and the next sync loads it and releases it
            plain.stop()
            lora_and_plain[1] = restart_lora_engine(plain.port, "plain-now-lora")
            await wait_for(lambda: _push_wanted(agent), 30, "the agent to ask for a push")
            await pub.publish(4, versions[0][1])
            status = {e.id: e for e in (await agent.rollout.status()).engines}
            assert status[ids[plain.url]].state == "healthy" and status[ids[lora.url]].state == "healthy"
            async with EngineClient(plain.url) as c:
                assert await c.weight_version() == 4 and await c.lora_adapters() == [f"{RUN_ID}-v4"]
        finally:
            await pub.close()


async def test_an_agent_refuses_to_start_when_its_engines_cannot_serve_the_adapter(tmp_path, nats_server, lora_and_plain):
    from sync_agent.agent import PolicyRefused, SyncAgent

    lora, plain = lora_and_plain
    cases = [([plain.url], LORA, f"engine {plain.url} does not serve LoRA adapters"),
             ([lora.url], (*LORA, "actor.lora_rank=16"), "actor.lora_rank=16 is over engine"),
             ([lora.url], (*LORA, "actor.target_modules=all-linear"), "which engine")]
    for urls, extra, message in cases:
        agent = SyncAgent(config(tmp_path, nats_server.url, urls, *extra))
        try:
            with pytest.raises(PolicyRefused, match=message):
                await agent.start()
        finally:
            await agent.close()
    fine = SyncAgent(config(tmp_path, nats_server.url, [lora.url], *LORA))
    try:
        assert await fine.coordinator.problems_at_start() == []
        merged = SyncAgent(config(tmp_path, nats_server.url, [plain.url], *LORA, "sync.lora_weights=merged"))
        assert await merged.coordinator.problems_at_start() == []
        await merged.close()
    finally:
        await fine.close()


async def test_an_adapter_sync_the_agent_died_in_is_rolled_back_without_reloads(tmp_path, nats_server, lora_and_plain):
    """Recovery after a restart (``sync_agent.reconcile.recover``) of an adapter sync left in
    ``loading``: the engines' base weights were never touched, so no engine is marked for a
    reload from disk (there is no full push to wait for in an adapter run); one at neither
    version is held out until the next sync, the run resumes at the previous version."""
    from sync_agent.reconcile import recover
    from sync_agent.records import AdapterRef, SyncRecord

    lora, _ = lora_and_plain
    (model, snap), = snapshots(tmp_path, 1)
    async with stack(tmp_path, nats_server.url, [lora.url], *LORA) as (svc, _, agent, agent_url, cfg):
        pub = adapter_publisher(agent_url, cfg, tmp_path)
        try:
            await pub.publish(1, snap)
        finally:
            await pub.close()
        co = agent.coordinator
        eid = next(iter((await agent.rollout.status()).engines)).id
        async with EngineClient(lora.url) as c:
            await c.update_weight_version(7, abort_all_requests=False)  # neither the old version nor the new
        rec = SyncRecord(version=2, group=None, buckets=[], adapter=AdapterRef(name=f"{RUN_ID}-v2", nbytes=1),
                         urls={eid: lora.url}, previous_version=1)
        rec.enter("loading")
        co.records.append(rec)
        co.unfinished = rec
        assert await recover(co) == "failed"
        assert co.version == 1 and not co.needs_reload and "rolled back to version 1" in rec.error
        engine = next(e for e in (await agent.rollout.status()).engines if e.id == eid)
        assert engine.state == "quarantined" and svc.runner.version == 1


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "../x", "", "x" * 161])
def test_an_adapter_name_that_could_be_a_path_is_refused(name):
    from pydantic import ValidationError

    from asyncrl.wire.sync import AdapterSpec, SyncRequest

    with pytest.raises(ValidationError, match="name"):
        SyncRequest(version=1, adapter=AdapterSpec(name=name, config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},
                                                   tensors="AAAA"))


LORA_ENGINE = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj")


async def test_adapter_syncs_refuse_engines_whose_release_asserts_one_data_parallel_replica(tmp_path, nats_server):
    """Issue 66 N6: SGLang's LoRA routes assert ``dp_size == 1`` (0.5.15-0.5.16 and 0.5.22+;
    0.5.17-0.5.21 also accept dp attention), an HTTP 500 at every adapter sync. local_engine
    answers as each release does, and the sync agent refuses such an engine at start, naming
    the flag; the same replicas with dp attention on 0.5.21 are served."""
    import httpx

    from sync_agent.agent import PolicyRefused, SyncAgent

    strict = start_engine(tmp_path, *ENGINE_ARGS, *LORA_ENGINE, "--dp-size", "2", "--sglang-compat", "0.5.23", name="dp-strict")
    attention = start_engine(tmp_path, *ENGINE_ARGS, *LORA_ENGINE, "--dp-size", "2", "--enable-dp-attention",
                             "--sglang-compat", "0.5.21", name="dp-attention")
    try:
        body = {"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(f"{strict.url}/load_lora_adapter", json=body)
            assert answer.status_code == 500 and "data-parallel replicas are not supported for dynamic lora loading" \
                in answer.text, answer.text
            answer = await http.post(f"{attention.url}/load_lora_adapter", json=body)
            assert answer.status_code == 400, answer.text  # past the assert: the adapter directory is missing
        agent = SyncAgent(config(tmp_path, nats_server.url, [strict.url], *LORA))
        try:
            with pytest.raises(PolicyRefused, match=r"runs --dp-size 2: sglang 0\.5\.23 asserts dp_size == 1 when it loads an "
                                                     r"adapter \(an HTTP 500 at every adapter sync\)"):
                await agent.start()
        finally:
            await agent.close()
        fine = SyncAgent(config(tmp_path, nats_server.url, [attention.url], *LORA))
        try:
            assert await fine.coordinator.problems_at_start() == []
        finally:
            await fine.close()
    finally:
        strict.stop()
        attention.stop()


def test_auto_sends_an_adapter_too_big_to_repeat_per_tp_rank_by_path_when_storage_is_shared():
    """Issue 66 N10: ``/load_lora_adapter_from_tensors`` repeats the adapter once per TP rank in
    one body; under ``auto`` with ``sync.adapter_dir`` named (storage the engines read) an adapter
    whose bytes × ``tp_size`` exceed the bound goes by path; without shared storage, or below the
    bound, by tensors; an explicit transport is kept."""
    from asyncrl.sync_control.adapter_load import TENSORS_BODY_MAX_BYTES, pick_transport
    from asyncrl.wire.sync import AdapterSpec

    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    big = AdapterSpec(name="run-v1", config=config, tensors="x", path="/shared/run-v1", nbytes=TENSORS_BODY_MAX_BYTES // 4 + 1)
    info = {"enable_lora": True, "tp_size": 4}
    assert pick_transport(info, "auto", big, shared_dir=True) == "path"
    assert pick_transport({**info, "tp_size": 2}, "auto", big, shared_dir=True) == "tensors"
    assert pick_transport(info, "auto", big, shared_dir=False) == "tensors"
    assert pick_transport(info, "tensors", big, shared_dir=True) == "tensors"
