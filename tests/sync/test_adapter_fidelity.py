"""Adapter syncs as each SGLang release takes them (issue 46 items 1, 4-8), through the real
sync agent and rollout service against local_engine emulating the release, strict as SGLang
(``--sglang-fatal-errors``: it exits where SGLang's server would), behind a recording proxy:

- one copy of the tensors per TP rank (``--tp-size 2``: a single entry kills rank 1 of SGLang);
- the tensors transport on every release (0.5.17+: ``serialized_named_tensors``; 0.5.15-0.5.16:
  ``serialized_tensors``), the path transport when forced, end to end on 0.5.18;
- no begin/end weight session around an adapter (the load step only sets the version);
- a load refused for "an incomplete unload" (0.5.21+) is unloaded and retried once;
- an engine that dies on a corrupted payload (as SGLang's does) is quarantined, and repaired by
  the push the agent asks for once it is back.
"""

from __future__ import annotations

import pytest

from asyncrl import failpoints
from asyncrl.engine_client import EngineClient
from asyncrl.sync_control.errors import WeightSyncError
from tests.helpers.processes import start_engine
from tests.helpers.recording_proxy import RecordingProxy
from tests.helpers.reference_model import teacher_forced_logprobs
from tests.helpers.waiting import wait_for
from tests.sync.conftest import ENGINE_ARGS, stack
from tests.sync.test_adapter_sync import (
    GREEDY,
    LORA,
    PROMPT,
    RUN_ID,
    _push_wanted,
    adapter_publisher,
    snapshots,
)

LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj", "--sglang-fatal-errors")
PARTIAL = "local_engine.lora_partial_load"


def paths(proxy) -> list[str]:
    return [path for _, path, _, _ in proxy.requests]


def bodies(proxy, path: str) -> list[dict]:
    return [body for _, p, _, body in proxy.requests if p == path]


async def sync_and_check(tmp_path, nats_url, engine, *extra, version_count: int = 1):
    """Adapter syncs of versions 1..version_count through the agent; the proxy and the last
    adapter's model (its log-probs are checked on the engine)."""
    versions = snapshots(tmp_path, version_count)
    proxy = await RecordingProxy(engine.url).start()
    try:
        async with stack(tmp_path, nats_url, [proxy.url], *LORA, *extra) as (svc, _, agent, agent_url, cfg):
            pub = adapter_publisher(agent_url, cfg, tmp_path)
            try:
                for v in range(1, version_count + 1):
                    await pub.publish(v, versions[v - 1][1])
                    assert agent.coordinator.records[-1].state == "succeeded", agent.coordinator.records[-1].error
            finally:
                await pub.close()
            async with EngineClient(engine.url) as c:
                res = await c.generate(PROMPT, GREEDY, extra={"lora_path": f"{RUN_ID}-v{version_count}"})
            want = teacher_forced_logprobs(versions[-1][0], PROMPT, res.output_ids)
            assert res.logprobs == pytest.approx(want, abs=1e-4)
    finally:
        await proxy.stop()
    return proxy


async def test_an_adapter_reaches_every_tp_rank_and_opens_no_weight_session(tmp_path, nats_server):
    with start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, "--tp-size", "2", name="lora-tp2") as engine:
        proxy = await sync_and_check(tmp_path, nats_server.url, engine, version_count=2)
        assert engine.proc.poll() is None, "the engine died on the adapter payload"
    loads = bodies(proxy, "/load_lora_adapter_from_tensors")
    assert len(loads) == 2 and all(len(b["serialized_named_tensors"]) == 2 for b in loads)
    assert loads[0]["serialized_named_tensors"][0] == loads[0]["serialized_named_tensors"][1]
    assert "/begin_weight_update" not in paths(proxy) and "/end_weight_update" not in paths(proxy)


@pytest.mark.parametrize(("release", "field"), [("0.5.18", "serialized_named_tensors"), ("0.5.15", "serialized_tensors")])
async def test_older_releases_take_the_tensors(tmp_path, nats_server, release, field):
    with start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, "--sglang-compat", release, name=f"lora-{release}") as engine:
        proxy = await sync_and_check(tmp_path, nats_server.url, engine)
    (load,) = bodies(proxy, "/load_lora_adapter_from_tensors")
    assert field in load and "/load_lora_adapter" not in paths(proxy)
    assert ("expected_checksums" in load) == (release != "0.5.15")


async def test_the_path_transport_runs_end_to_end(tmp_path, nats_server):
    with start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, "--sglang-compat", "0.5.18", name="lora-path") as engine:
        proxy = await sync_and_check(tmp_path, nats_server.url, engine, "sync.adapter_transport=path")
    (load,) = bodies(proxy, "/load_lora_adapter")
    assert load["lora_name"] == f"{RUN_ID}-v1" and load["lora_path"].endswith(f"{RUN_ID}-v1")
    assert "/load_lora_adapter_from_tensors" not in paths(proxy)


async def test_a_load_left_incomplete_is_unloaded_and_retried(tmp_path, nats_server):
    points = tmp_path / "failpoints"
    points.mkdir()
    (_, snap), = snapshots(tmp_path, 1)
    with start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, env={failpoints.ENV_DIR: str(points)}, name="lora-partial") as engine:
        proxy = await RecordingProxy(engine.url).start()
        try:
            async with stack(tmp_path, nats_server.url, [proxy.url], *LORA) as (svc, _, agent, agent_url, cfg):
                pub = adapter_publisher(agent_url, cfg, tmp_path)
                try:
                    (points / f"{PARTIAL}.arm").touch()  # one rank loads it, another fails: SGLang 0.5.21+
                    with pytest.raises(WeightSyncError):
                        await pub.publish(1, snap)
                    assert failpoints.reached(points, PARTIAL)
                    (points / f"{PARTIAL}.arm").unlink()
                    await pub.publish(1, snap)  # the trainer's retry of the same version: the same name
                    assert agent.coordinator.records[-1].state == "succeeded", agent.coordinator.records[-1].error
                finally:
                    await pub.close()
        finally:
            await proxy.stop()
    name = f"{RUN_ID}-v1"
    calls = [(p, b.get("lora_name")) for _, p, _, b in proxy.requests if "lora_adapter" in p]
    assert calls[-3:] == [("/load_lora_adapter_from_tensors", name), ("/unload_lora_adapter", name),
                          ("/load_lora_adapter_from_tensors", name)], calls


async def test_an_engine_that_dies_on_a_bad_payload_is_held_out_then_repaired(tmp_path, nats_server):
    """Two engines at adapter v1; v2's payload reaches B corrupted (its checksums): B exits as
    SGLang's server does, the sync succeeds on A, B is out of routing; B restarted (its initial
    weights, no adapter) is repaired by the push the agent asks for."""
    (_, v1), (_, v2), (model3, v3) = snapshots(tmp_path, 3)
    good = start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, name="lora-good")
    dying = start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, name="lora-dies")
    proxies = [await RecordingProxy(e.url).start() for e in (good, dying)]

    def corrupt(method, path, body):
        if path == "/load_lora_adapter_from_tensors" and body["lora_name"] == f"{RUN_ID}-v2":
            return {**body, "expected_checksums": {k: "0" * 64 for k in body["expected_checksums"]}}
        return None

    proxies[1].rewrite = corrupt
    try:
        async with stack(tmp_path, nats_server.url, [p.url for p in proxies], *LORA) as (svc, _, agent, agent_url, cfg):
            ids = {e["url"]: e["id"] for e in svc.pool.snapshot()}
            a_id, b_id = ids[proxies[0].url], ids[proxies[1].url]
            pub = adapter_publisher(agent_url, cfg, tmp_path)
            try:
                await pub.publish(1, v1)
                await pub.publish(2, v2)
                assert dying.proc.proc.wait(timeout=30) == 70, "SGLang's server exits on a checksum mismatch: so does this one"
                rec = agent.coordinator.records[-1]
                assert rec.state == "succeeded" and rec.engines[a_id] == "loaded" and rec.engines[b_id] != "loaded", rec.engines
                assert svc.pool.engines[b_id].state in ("quarantined", "unhealthy"), "out of routing: treated as dead"
                dying = start_engine(tmp_path, *ENGINE_ARGS, *LORA_FLAGS, port=dying.port, name="lora-back")
                await wait_for(lambda: _push_wanted(agent), 60, "the agent to ask for a push")
                await pub.publish(3, v3)
                assert agent.coordinator.records[-1].state == "succeeded", agent.coordinator.records[-1].error
                await wait_for(lambda: svc.pool.engines[b_id].state == "healthy", 30, "B released")
            finally:
                await pub.close()
        async with EngineClient(dying.url) as c:
            res = await c.generate(PROMPT, GREEDY, extra={"lora_path": f"{RUN_ID}-v3"})
        assert res.logprobs == pytest.approx(teacher_forced_logprobs(model3, PROMPT, res.output_ids), abs=1e-4)
    finally:
        for p in proxies:
            await p.stop()
        good.stop()
        dying.stop()
